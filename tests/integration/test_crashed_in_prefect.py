"""A `ppoflow train` killed with SIGKILL is marked Crashed in Prefect by the next start of the same run, and
`prefect flow-run retry ID --entrypoint flows/training.py:ppo_training` (the README's command) resumes it.

Sequence: start 1 is killed in iteration 1's update; start 2 marks start 1's flow run Crashed and is killed
itself before iteration 1; the retry of start 1 (a new process, Prefect's own CLI) marks start 2 Crashed,
trains both iterations and ends Completed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}


def _killed_train(config_path: Path, kill: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.fixtures.kill_cli", kill, "train", str(config_path)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _training_runs(client, name: str) -> list:
    """Flow runs of the run's training flow, oldest first."""
    runs = [fr for fr in client.read_flow_runs(limit=200) if fr.name == f"ppo-training-{name}"]
    return sorted(runs, key=lambda fr: fr.created)


def test_a_killed_run_is_marked_crashed_and_the_prefect_retry_resumes_it(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from prefect.client.orchestration import get_client

    from storage.checkpoints import latest_iteration
    from storage.layout import layout_for

    cfg = small_config(str(tmp_path / "runs"), "crashy", tiny_model_dir, digits_dataset_dir, iterations=2)
    config_path = tmp_path / "crashy.yaml"
    config_path.write_text(cfg.to_yaml())

    first = _killed_train(config_path, "engines.stages.update:train_on@1")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    with get_client(sync_client=True) as client:
        (run_1,) = _training_runs(client, "crashy")
        assert run_1.state.type.value == "RUNNING"  # nobody told Prefect

    second = _killed_train(config_path, "flows.training:ppo_iteration@1")
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    with get_client(sync_client=True) as client:
        run_1, run_2 = _training_runs(client, "crashy")
        assert run_1.state.type.value == "CRASHED" and "died" in run_1.state.message, run_1.state
        subflows = [
            fr
            for fr in client.read_flow_runs(limit=200)
            if fr.parent_task_run_id is not None
            and fr.name.startswith("ppo-iter-")
            and fr.state.type.value == "RUNNING"
        ]
        assert subflows == [], [(fr.name, fr.state) for fr in subflows]  # start 1's iteration subflow too

    retry = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "flow-run",
            "retry",
            str(run_1.id),
            "--entrypoint",
            "flows/training.py:ppo_training",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    with get_client(sync_client=True) as client:
        run_1, run_2 = _training_runs(client, "crashy")
        assert run_1.state.type.value == "COMPLETED", run_1.state
        assert run_2.state.type.value == "CRASHED", run_2.state
    assert latest_iteration(layout_for(cfg)) == 2
