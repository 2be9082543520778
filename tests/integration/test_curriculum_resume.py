"""A curriculum run SIGKILLed across a level change ends as if never killed (data.reasoning_gym.curriculum).

The curriculum is synthetic so the level changes are known in advance: reasoning-gym's basic_arithmetic on the tiny
model (which scores ~0), promote_at 0 and promote_after 1, so every iteration's reward (>= 0) promotes: iteration 1
trains at level 0, 2 at level 1, 3 at level 2 (the top: target_level 2). The run of 3 iterations is killed
(tests/fixtures/kill_cli.py, SIGKILL) while iteration 2 commits (its checkpoint holds the move to level 2; iteration 1
committed level 1), and then, in the next start, while iteration 3's rollout writes its level-2 shards.

Then: every weight and optimizer file of the final checkpoint and its curriculum.json are byte-equal to a run never
killed; each iteration's rollout shards carry curriculum_level 0, 1, 2 (one level per iteration); the metrics rows
say curriculum/level 0, 1, 2 and curriculum/next_level 1, 2, 2.

Fork: `ppoflow fork never-killed --at 2` (nothing changed; retention keeps checkpoints 2 and 3) starts at the level
iteration 2 committed (2), not at start_level (0): its iteration 3 samples at level 2, and its checkpoint 3 (weights,
optimizer state, curriculum.json) is byte-equal to the parent's.
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
from tests.integration.test_pipeline_crash import _DISTRIBUTED_VARS, REPO, _digests, _train

pytestmark = pytest.mark.slow

KILLS = ["storage.checkpoints:_write_marker@2", "stages.rollout:write_stage_table@1"]
CURRICULUM = {"target_level": 2, "start_level": 0, "promote_at": 0.0, "promote_after": 1}


def _config_file(tmp_path: Path, root: str, name: str, model_dir, data_dir) -> Path:
    cfg = small_config(
        root,
        name,
        model_dir,
        data_dir,
        iterations=3,
        data={"reasoning_gym": {"task": "basic_arithmetic", "size": 64, "seed": 1, "curriculum": CURRICULUM}},
        reward={"sources": [{"kind": "function", "target": "engines.rewards.reasoning_tasks:score_last_number"}]},
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _levels(layout, iteration: int) -> list[int]:
    from storage.shards import read_shards

    table = read_shards(layout.fs, layout.stage_dir(iteration, "rollout"), columns=["curriculum_level"])
    return sorted(set(table.column("curriculum_level").to_pylist()))


def _fork(root: str, run: str, at: int, name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    command = [sys.executable, "-m", "cli", "fork", run, "--at", str(at), "--name", name, "--root", root]
    return warm_python.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_a_curriculum_run_killed_across_level_changes_resumes_at_the_same_level_and_forks_at_its_level(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from flows.records import read_metrics
    from storage.checkpoints import latest_iteration
    from storage.layout import RunLayout

    root = str(tmp_path / "runs")
    killed_path = _config_file(tmp_path, root, "killed", tiny_model_dir, digits_dataset_dir)
    layout = RunLayout(root, "killed")
    for spec, latest_after in zip(KILLS, (1, 2)):
        result = _train(killed_path, kill=spec)
        assert result.returncode == -signal.SIGKILL, (spec, result.stderr[-3000:])
        assert latest_iteration(layout) == latest_after, spec
    state_1 = json.loads((Path(layout.checkpoint_dir(1)) / "curriculum.json").read_text())
    assert state_1 == {"level": 1, "streak": 0}  # iteration 1 promoted 0 -> 1 and was committed before the kills
    final = _train(killed_path)
    assert final.returncode == 0, final.stderr[-3000:]

    clean_path = _config_file(tmp_path, root, "never-killed", tiny_model_dir, digits_dataset_dir)
    assert _train(clean_path, fresh=True).returncode == 0
    clean = RunLayout(root, "never-killed")
    last, clean_last = Path(layout.checkpoint_dir(3)), Path(clean.checkpoint_dir(3))
    assert _digests(last) == _digests(clean_last)
    assert (last / "curriculum.json").read_bytes() == (clean_last / "curriculum.json").read_bytes()
    assert json.loads((last / "curriculum.json").read_text()) == {"level": 2, "streak": 1}  # top: stays, streak 1
    for run in (layout, clean):
        assert [_levels(run, i) for i in (1, 2, 3)] == [[0], [1], [2]]
        rows = read_metrics(run)
        assert [r["curriculum/level"] for r in rows] == [0, 1, 2]
        assert [r["curriculum/next_level"] for r in rows] == [1, 2, 2]
        assert all(0 <= r["curriculum/reward_at_level"] <= 1 for r in rows)

    forked = _fork(root, "never-killed", 2, "forked")
    assert forked.returncode == 0, forked.stderr[-3000:]
    fork = RunLayout(root, "forked")
    assert _levels(fork, 3) == [2]  # iteration 2 committed level 2: the fork starts there, not at start_level 0
    assert [r["curriculum/level"] for r in read_metrics(fork)] == [2]
    fork_last = Path(fork.checkpoint_dir(3))
    assert _digests(fork_last) == _digests(clean_last)
    assert (fork_last / "curriculum.json").read_bytes() == (clean_last / "curriculum.json").read_bytes()
