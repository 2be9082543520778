"""The kill matrix: `ppoflow train` SIGKILLed at eight moments, each time started again with the same command.

One run of 3 iterations is killed (tests/fixtures/kill_cli.py: SIGKILL at the N-th call of a function; no
exception handler, `finally` or atexit hook runs: a power cut, the OOM killer) at, in turn:

    iteration 1: rollout writing shards, score writing shards, update before its PPO step, checkpoint files in
                 scratch before staging, the commit before its marker, after the commit before the metrics row
    iteration 3: before the iteration starts (2 is done), after the commit before retention

Every start resumes (LATEST + 1, cached stages from the persisted results) and the last one finishes. Then:
every weight file of the final checkpoint (policy, critic, trainer state with the optimizer) is byte-equal to
a run never killed; metrics.jsonl has rows 1, 2, 3 once each, equal to the never-killed run's but for
timings (a row lost between commit and metrics write is rebuilt from the stage records); a committed
checkpoint is never rewritten; the dead process's scratch folder is removed by the next save.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import warm_python
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# Set in os.environ by DeepSpeed set-up in this test process (earlier tests): a child must pick its own
# rendezvous port, or it would try to listen where this process already does.
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# (kill spec for one start, what must hold after it): in the order the starts run.
KILLS = [
    ("stages.rollout:write_stage_table@1", "rollout"),
    ("stages.score:write_stage_table@1", "score"),
    ("stages.update:train_on@1", "update"),
    ("stages.update:save_checkpoint_files@1", "staging"),
    ("storage.checkpoints:_write_marker@1", "commit"),
    ("flows.iteration:record_metrics@1", "metrics"),
    ("flows.training:ppo_iteration@2", "between iterations"),
    ("storage.checkpoints:apply_retention@1", "retention"),
]
COMPARED = (
    "reward/mean",
    "loss/policy",
    "loss/value",
    "kl/mean",
    "rollout/rows",
)  # not cache hits: the runs share the score cache


def _train(config_path: Path, kill: str | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """`ppoflow train CONFIG` in a child process, killed by `kill` (a kill_cli spec) when given. Forked from the test
    zygote (tests/fixtures/warm_python.py), or with `fresh` a new interpreter: the never-killed reference runs, so a
    result that depends on Python's string hash order differs from the killed run's."""
    child_env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    entry = ["cli"] if kill is None else ["tests.fixtures.kill_cli", kill]
    return (subprocess.run if fresh else warm_python.run)(
        [sys.executable, "-m", *entry, "train", str(config_path)],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint's policy/, critic/ and trainer/, but the trainer's copy of the config
    (it names the run) and its record of the process's RNG state (which other stages of the process draw from
    too: a resumed process restores it when the trainer is built, after that iteration's rollout and score)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for part in ("policy", "critic", "trainer")
        for p in sorted((folder / part).rglob("*"))
        if p.is_file() and not (part == "trainer" and (p.name == "config.json" or p.name.startswith("rng.")))
    }


def _config_file(tmp_path: Path, root: str, name: str, model_dir, data_dir) -> Path:
    cfg = small_config(root, name, model_dir, data_dir, iterations=3, run={"keep_checkpoints": 2})
    path = tmp_path / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def test_a_run_killed_at_eight_moments_ends_as_if_never_killed(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from flows.records import read_metrics
    from storage.checkpoints import latest_iteration
    from storage.layout import RunLayout

    root = str(tmp_path / "runs")
    killed_path = _config_file(tmp_path, root, "killed", tiny_model_dir, digits_dataset_dir)
    layout = RunLayout(root, "killed")
    checkpoints = Path(layout.checkpoints_dir)
    committed: dict[str, dict[str, str]] = {}
    for spec, moment in KILLS:
        result = _train(killed_path, kill=spec)
        assert result.returncode == -signal.SIGKILL, (moment, result.stderr[-3000:])
        for name, digests in committed.items():  # a committed checkpoint is never rewritten
            if (checkpoints / name).is_dir():
                assert _digests(checkpoints / name) == digests, (moment, name)
        latest = latest_iteration(layout) or 0
        committed.update(
            {
                p.name: _digests(p)
                for p in checkpoints.glob("iter-*")
                if int(p.name[-6:]) <= latest and p.name not in committed
            }
        )
        if moment == "staging":  # the dead process's half-done save is left in scratch ...
            assert any(p.name.startswith(".ppoflow-ckpt.") for p in checkpoints.iterdir())
        rows = [r["iteration"] for r in read_metrics(layout)]
        assert rows == sorted(set(rows)) and set(rows) <= set(range(1, latest + 1)), (moment, rows)
    assert latest_iteration(layout) == 3
    final = _train(killed_path)
    assert final.returncode == 0, final.stderr[-3000:]
    assert not any(p.name.startswith(".ppoflow-ckpt.") for p in checkpoints.iterdir())  # ... and removed

    clean_path = _config_file(tmp_path, root, "never-killed", tiny_model_dir, digits_dataset_dir)
    assert _train(clean_path, fresh=True).returncode == 0
    clean = RunLayout(root, "never-killed")
    # Same seeds, data and ops on one CPU rank, each start in a fresh process: every byte equal.
    want = _digests(Path(clean.checkpoints_dir) / "iter-000003")
    assert {k for k in want if k.endswith(".safetensors")} >= {"policy/model.safetensors", "critic/model.safetensors"}
    assert _digests(checkpoints / "iter-000003") == want
    rows, clean_rows = read_metrics(layout), read_metrics(clean)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for row, clean_row in zip(rows, clean_rows):
        for key in COMPARED:
            assert row[key] == clean_row[key], (row["iteration"], key)
