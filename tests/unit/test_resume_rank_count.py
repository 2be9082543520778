"""Resuming a checkpoint on another number of ranks: allowed where every rank's optimizer state is whole and equal
(ZeRO stage 0, float32, in the checkpoint AND in the run), refused naming both counts everywhere else, before any
rank starts (update_ranks.check_saved_ranks; the trainer's own load applies the same rule)."""

import json

import pytest

from engines.stages.update_ranks import check_saved_ranks
from engines.trainer.checkpoint import replicated_optimizer_state
from ppoflow.config import load_config


def _checkpoint(tmp_path, world: int, zero_stage: int, dtype: str = "float32") -> str:
    """A checkpoint folder whose trainer/ holds what save_trainer writes about ranks and the run config."""
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    (trainer / "trainer.json").write_text(json.dumps({"update_count": 1, "world_size": world}))
    saved = load_config(None, [f"train.zero_stage={zero_stage}", f"model.dtype={dtype}"])
    (trainer / "config.json").write_text(json.dumps(saved.model_dump(mode="json")))
    return str(tmp_path)


def _run(zero_stage: int, dtype: str = "float32", ranks: int = 1):
    return load_config(None, [f"train.zero_stage={zero_stage}", f"model.dtype={dtype}", f"train.num_ranks={ranks}"])


def test_zero_0_float32_resumes_on_another_count(tmp_path):
    ckpt = _checkpoint(tmp_path, world=2, zero_stage=0)
    assert replicated_optimizer_state(f"{ckpt}/trainer", _run(0))
    check_saved_ranks(ckpt, 4, _run(0, ranks=4))  # no error: 2 -> 4 ranks


@pytest.mark.parametrize(
    "saved_stage, saved_dtype, run_stage, run_dtype",
    [
        (2, "float32", 2, "float32"),  # partitions on both sides
        (1, "float32", 1, "float32"),
        (3, "float32", 3, "float32"),
        (0, "float32", 2, "float32"),  # a stage-2 run would need partitions the checkpoint does not have
        (0, "bfloat16", 0, "bfloat16"),  # DeepSpeed's bf16 optimizer partitions its fp32 master weights
    ],
)
def test_other_layouts_are_refused_naming_both_counts(tmp_path, saved_stage, saved_dtype, run_stage, run_dtype):
    ckpt = _checkpoint(tmp_path, world=2, zero_stage=saved_stage, dtype=saved_dtype)
    assert not replicated_optimizer_state(f"{ckpt}/trainer", _run(run_stage, run_dtype))
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\) but train.num_ranks=4.*set train.num_ranks=2"):
        check_saved_ranks(ckpt, 4, _run(run_stage, run_dtype, ranks=4))


def test_a_checkpoint_without_its_config_is_refused(tmp_path):
    # written before trainer/config.json existed: nothing says its layout, so only its own count resumes it
    ckpt = _checkpoint(tmp_path, world=2, zero_stage=0)
    (tmp_path / "trainer" / "config.json").unlink()
    check_saved_ranks(ckpt, 2, _run(0, ranks=2))
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\) but train.num_ranks=4"):
        check_saved_ranks(ckpt, 4, _run(0, ranks=4))
