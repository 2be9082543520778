"""Reward code that tries to end the process, through `ppoflow train`: one message, the committed run untouched,
and the printed resume command continues the run once the code is fixed.

A run with one committed iteration scores with a reward function (isolation "thread", the default) that calls
`sys.exit(3)` or `os._exit(7)` when PPOFLOW_TEST_REWARD_ENDS says so (an environment variable, so the run's
config stays the same and its resume is not refused as a changed setting). Before the fix the command ended
with exit code 3, or 7, and printed no `ppoflow: error:` at all.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures import warm_python
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

RUN = "ends"
REWARD = textwrap.dedent("""
    import os, sys
    from engines.toy.task import reward_func

    def reward(queries, prompts, labels, **kwargs):
        how = os.environ.get("PPOFLOW_TEST_REWARD_ENDS", "")
        if how == "sys.exit":
            sys.exit(3)
        if how == "os._exit":
            os._exit(7)
        return reward_func(queries, prompts, labels, **kwargs)
""")
# Written by a failed resume and allowed to change: its log, the uncommitted iteration 2, Prefect's results, and
# config.yaml (rewritten with run.iterations = 2, a location key).
UNCOMMITTED = ("logs", "iter-000002", "_prefect_results", "config.yaml")


def committed_digest(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.relative_to(run_dir).parts[0] not in UNCOMMITTED
    }


@pytest.fixture(scope="module")
def committed_run(tmp_path_factory, tiny_model_dir, digits_dataset_dir, prefect_server):
    """(resume config path, run folder): one iteration committed with the reward of REWARD."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.training import ppo_training

    work = tmp_path_factory.mktemp("reward-exit")
    (work / "ends_reward.py").write_text(REWARD)
    cfg = small_config(
        str(work / "runs"),
        RUN,
        tiny_model_dir,
        digits_dataset_dir,
        iterations=1,
        reward={"sources": [{"kind": "function", "target": f"{work / 'ends_reward.py'}:reward", "name": "ends"}]},
    )
    with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
        assert ppo_training(config=cfg.model_dump(mode="json"), return_state=True).is_completed()
    config_path = work / "ends.yaml"
    config_path.write_text(cfg.model_copy(update={"run": cfg.run.model_copy(update={"iterations": 2})}).to_yaml())
    return config_path, work / "runs" / RUN


def _train(args: list[str], ends: str = "") -> subprocess.CompletedProcess:
    # Not the rendezvous variables the fixture's in-process update set: its port is still held by this process.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=os.getcwd(), PPOFLOW_TEST_REWARD_ENDS=ends)
    return warm_python.run([sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("ends, call", [("sys.exit", "sys.exit(3)"), ("os._exit", "os._exit(7)")])
def test_reward_code_that_ends_the_process_is_one_message(committed_run, prefect_api, ends, call):
    config_path, run_dir = committed_run
    before = committed_digest(run_dir)
    done = _train(["train", str(config_path)], ends=ends)
    output = done.stdout + done.stderr
    assert done.returncode == 1, (done.returncode, output[-3000:])
    assert output.count("ppoflow: error:") == 1, output[-3000:]
    error = output[output.index("ppoflow: error:") :].splitlines()
    target = f"{run_dir.parent.parent / 'ends_reward.py'}:reward"
    assert error[0].startswith(f"ppoflow: error: RewardError: reward source 'ends' ({target}) called {call} on iter 2 ")
    assert error[1] == f"  where:   stage score, iteration 2, run {RUN} at {run_dir}"
    assert error[3] == f"  resume:  ppoflow train {config_path}"
    assert committed_digest(run_dir) == before, "a committed file changed"
    assert not (run_dir / "checkpoints" / "iter-000002").exists()


def test_the_printed_resume_command_continues_the_run(committed_run, prefect_api):
    from ppoflow.config import load_config
    from storage.checkpoints import latest_iteration
    from storage.layout import layout_for

    config_path, _run_dir = committed_run
    failed = _train(["train", str(config_path)], ends="sys.exit")
    resume = next(line for line in failed.stdout.splitlines() if line.startswith("  resume:  "))
    argv = shlex.split(resume.removeprefix("  resume:  "))
    assert argv[0] == "ppoflow"
    done = _train(argv[1:])  # the reward code fixed: no exit any more
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert latest_iteration(layout_for(load_config(config_path))) == 2
