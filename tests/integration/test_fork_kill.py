"""A fork killed during its first iteration resumes: `ppoflow fork` SIGKILLed (tests/fixtures/kill_cli.py: no
handler, `finally` or atexit runs) while scoring its replayed iteration 3, then while updating, then the same command
again: forking again is a no-op, training resumes at the fork's LATEST + 1 and finishes.

The fork changes nothing and replays the parent's iteration 3 (--replay 1), so its checkpoint 3 must equal the
parent's, byte for byte (weights, critic, optimizer state), and its metrics.jsonl holds row 3 once, with the parent's
reward: a kill changes nothing of the result. Its iteration folder holds no rollout shards; its rollout record
names the parent's rows (their content hash).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import warm_python
from tests.integration.pipeline_helpers import small_config
from tests.integration.test_fork import _digests

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
KILLS = ["stages.score:write_stage_table@1", "stages.update:train_on@1"]


def _fork(root: str, kill: str | None) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    entry = ["cli"] if kill is None else ["tests.fixtures.kill_cli", kill]
    args = ["fork", "base", "--at", "2", "--name", "killed", "--root", root, "--replay", "1"]
    return warm_python.run(
        [sys.executable, "-m", *entry, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_a_fork_killed_in_its_first_iteration_resumes_to_the_same_result(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from flows.training import ppo_training
    from storage.checkpoints import latest_iteration
    from storage.layout import RunLayout
    from storage.metrics import read_metrics

    root = str(tmp_path / "root")
    base = small_config(root, "base", tiny_model_dir, digits_dataset_dir, iterations=3, run={"keep_checkpoints": 3})
    assert ppo_training(config=base.model_dump(mode="json"), return_state=True).is_completed()
    fork = RunLayout(root, "killed")
    for kill in KILLS:
        result = _fork(root, kill)
        assert result.returncode == -signal.SIGKILL, (kill, result.stdout[-2000:], result.stderr[-3000:])
        assert latest_iteration(fork) == 2 and read_metrics(fork) == []  # nothing of 3 committed
    result = _fork(root, None)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])

    base_dir, fork_dir = Path(root, "base"), Path(root, "killed")
    assert latest_iteration(fork) == 3
    assert _digests(fork_dir / "checkpoints/iter-000003") == _digests(base_dir / "checkpoints/iter-000003")
    (row,) = read_metrics(fork)
    parent_row = next(r for r in read_metrics(RunLayout(root, "base")) if r["iteration"] == 3)
    assert (row["iteration"], row["reward/mean"], row["rollout/replayed"]) == (3, parent_row["reward/mean"], 1.0)
    record = json.loads((fork_dir / "iter-000003/_stages/rollout.json").read_text())
    assert (
        record["content_hash"]
        == json.loads((base_dir / "iter-000003/_stages/rollout.json").read_text())["content_hash"]
    )
    assert not (fork_dir / "iter-000003/rollout").exists()
