"""Exact resume of a multi-turn run after a kill: `ppoflow train` SIGKILLed in the middle of a conversation
(between two turns of the rollout, environments open) and in the update, started again with the same command
each time, ends byte-equal to a run never killed (tests/fixtures/kill_cli.py; the single-turn kill matrix is
tests/integration/test_pipeline_crash.py, whose helpers this reuses).

Why it holds: every turn's seed is a function of (run seed, iteration, row, sample, turn) and the scripted
environment is deterministic given the row and the conversation, so the rollout a resumed process draws again is
the one the killed process was drawing.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.pipeline_helpers import small_config
from tests.integration.test_multi_turn_pipeline import MULTI_TURN
from tests.integration.test_pipeline_crash import _digests, _train

pytestmark = pytest.mark.slow

# (kill spec, LATEST after the kill), in the order the starts run; each start is a fresh process.
KILLS = [
    ("engines.rollout.multi_turn:_step@13", None),  # iteration 1's rollout, its second turn (8 conversations)
    ("stages.update:train_on@1", None),  # iteration 1's update (its rollout and score came from cache)
    ("engines.rollout.multi_turn:_step@13", 1),  # iteration 2's rollout, mid-conversation
]


def _config_file(tmp_path: Path, root: str, name: str, model_dir, data_dir) -> Path:
    cfg = small_config(root, name, model_dir, data_dir, iterations=2, **MULTI_TURN)
    path = tmp_path / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def test_a_multi_turn_run_killed_mid_conversation_ends_as_if_never_killed(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from flows.records import read_metrics
    from storage.checkpoints import latest_iteration
    from storage.layout import RunLayout

    root = str(tmp_path / "runs")
    killed_path = _config_file(tmp_path, root, "mt-killed", tiny_model_dir, digits_dataset_dir)
    layout = RunLayout(root, "mt-killed")
    for spec, latest in KILLS:
        result = _train(killed_path, kill=spec)
        assert result.returncode == -signal.SIGKILL, (spec, result.stderr[-3000:])
        assert latest_iteration(layout) == latest, spec
    final = _train(killed_path)
    assert final.returncode == 0, final.stderr[-3000:]

    clean_path = _config_file(tmp_path, root, "mt-never-killed", tiny_model_dir, digits_dataset_dir)
    assert _train(clean_path, fresh=True).returncode == 0
    clean = RunLayout(root, "mt-never-killed")
    want = _digests(Path(clean.checkpoints_dir) / "iter-000002")
    assert "policy/model.safetensors" in want
    assert _digests(Path(layout.checkpoints_dir) / "iter-000002") == want
    rows, clean_rows = read_metrics(layout), read_metrics(clean)
    assert [r["iteration"] for r in rows] == [1, 2]
    for row, clean_row in zip(rows, clean_rows):
        for key in ("reward/mean", "loss/policy", "response/policy_tokens_mean", "response/length_mean"):
            assert row[key] == clean_row[key], (row["iteration"], key)
