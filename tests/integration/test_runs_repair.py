"""A corrupt latest checkpoint: `ppoflow runs repair` quarantines it, the next start recomputes that iteration
from the one before, and the recomputed checkpoint is byte-equal to the one before the corruption."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for part in ("policy", "critic")
        for p in sorted((folder / part).rglob("*"))
        if p.is_file()
    }


def test_repair_quarantines_a_corrupt_checkpoint_and_the_resume_recomputes_it(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from cli.main import main
    from engines import warm
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.checkpoints import CheckpointCorruptError, latest_iteration, load_checkpoint
    from storage.layout import layout_for

    root = tmp_path / "runs"
    cfg = small_config(str(root), "fixme", tiny_model_dir, digits_dataset_dir, iterations=2)
    assert ppo_training(config=cfg.model_dump(mode="json"), return_state=True).is_completed()
    layout = layout_for(cfg)
    second = Path(layout.checkpoint_dir(2))
    before = _digests(second)
    reward_2 = read_metrics(layout)[1]["reward/mean"]

    assert main(["runs", "repair", "fixme", "--root", str(root)]) == 0  # a sound checkpoint is left alone
    assert _digests(second) == before

    weights = second / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the weights (a bad disk, a torn copy)
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="runs repair"):
        load_checkpoint(layout, 2)

    assert main(["runs", "repair", "fixme", "--root", str(root)]) == 0
    assert latest_iteration(layout) == 1 and not second.exists()
    (quarantined,) = (root / "fixme" / "quarantine").iterdir()
    assert quarantined.name.startswith("iter-000002-") and (quarantined / "policy" / "model.safetensors").exists()

    warm.invalidate()  # the repaired run is started again by a new process
    assert ppo_training(config=cfg.model_dump(mode="json"), return_state=True).is_completed()
    assert latest_iteration(layout) == 2
    assert _digests(second) == before  # recomputed from checkpoint 1: the same bytes
    rows = read_metrics(layout)
    assert [r["iteration"] for r in rows] == [1, 2] and rows[1]["reward/mean"] == reward_2
