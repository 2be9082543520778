"""Resuming a checkpoint on another number of ranks (engines/trainer/reshard.py): which layouts may (the same ZeRO
stage 1-2, or 0 in float32), which are refused naming both counts before any rank starts
(update_ranks.check_saved_ranks; the trainer's own load applies the same rule), and ZeRO-1/2 partitions cut again
for the new count, checked on a hand-made layout."""

import json

import pytest
import torch

from engines.trainer.reshard import PARTITIONED, REPLICATED, other_count_mode, repartition
from ppoflow.config import load_config
from stages.update_ranks import check_saved_ranks


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


@pytest.mark.parametrize(
    "stage, dtype, mode",
    [
        (0, "float32", REPLICATED),
        (1, "float32", PARTITIONED),
        (2, "float32", PARTITIONED),
        (2, "bfloat16", PARTITIONED),
    ],
)
def test_layouts_that_resume_on_another_count(tmp_path, stage, dtype, mode):
    ckpt = _checkpoint(tmp_path, world=2, zero_stage=stage, dtype=dtype)
    assert other_count_mode(f"{ckpt}/trainer", _run(stage, dtype)) == mode
    check_saved_ranks(ckpt, 4, _run(stage, dtype, ranks=4))  # no error: 2 -> 4 ranks


@pytest.mark.parametrize(
    "saved_stage, saved_dtype, run_stage, run_dtype",
    [
        (3, "float32", 3, "float32"),  # ZeRO-3's per-parameter partitions are not cut again
        (0, "float32", 2, "float32"),  # another stage: another optimizer layout
        (2, "float32", 1, "float32"),
        (0, "bfloat16", 0, "bfloat16"),  # DeepSpeed's bf16 optimizer keeps its own fp32 copies
    ],
)
def test_other_layouts_are_refused_naming_both_counts(tmp_path, saved_stage, saved_dtype, run_stage, run_dtype):
    ckpt = _checkpoint(tmp_path, world=2, zero_stage=saved_stage, dtype=saved_dtype)
    assert other_count_mode(f"{ckpt}/trainer", _run(run_stage, run_dtype)) is None
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\) but train.num_ranks=4.*set train.num_ranks=2"):
        check_saved_ranks(ckpt, 4, _run(run_stage, run_dtype, ranks=4))


def test_a_checkpoint_without_its_config_is_refused(tmp_path):
    # nothing says how it was trained, so only its own count resumes it
    ckpt = _checkpoint(tmp_path, world=2, zero_stage=2)
    (tmp_path / "trainer" / "config.json").unlink()
    check_saved_ranks(ckpt, 2, _run(2, ranks=2))
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\) but train.num_ranks=4"):
        check_saved_ranks(ckpt, 4, _run(2, ranks=4))


def _zero12_state(flat: torch.Tensor, moment: torch.Tensor, size: int, rank: int, world: int) -> dict:
    """What DeepSpeed's ZeRO-1/2 state_dict() holds for one group of `flat` (10 weights) on `rank` of `world`
    partitions of `size` (the flat group zero-padded to size x world at its end, so the last rank is padded)."""
    padding = max(0, (rank + 1) * size - flat.numel()) if rank == world - 1 else 0
    cut = lambda t: torch.nn.functional.pad(t, (0, size * world - t.numel()))[rank * size : (rank + 1) * size]  # noqa: E731
    return {
        "base_optimizer_state": {
            "state": {0: {"exp_avg": cut(moment), "step": torch.tensor(5.0)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "single_partition_of_fp32_groups": [cut(flat)[: size - padding]],  # saved without padding
        "group_paddings": [padding],
        "partition_count": [world],
        "loss_scale": 1.0,
    }


def test_partitions_of_two_ranks_cut_for_three():
    # 10 weights. Saved on 2 ranks: padded to 12 (a multiple of 2 x 2), partitions of 6: rank 0 holds weights 0-5,
    # rank 1 weights 6-9 and 2 padding. On 3 ranks: padded to 12 (a multiple of 2 x 3), partitions of 4: rank 0
    # holds 0-3, rank 1 4-7, rank 2 8-9 and 2 padding.
    flat, moment = torch.arange(10.0), torch.arange(10.0) * -1 - 1
    saved = [_zero12_state(flat, moment, 6, r, 2) for r in range(2)]
    assert saved[1]["group_paddings"] == [2] and saved[1]["single_partition_of_fp32_groups"][0].tolist() == [6, 7, 8, 9]
    for rank, (weights, padding) in enumerate([([0, 1, 2, 3], 0), ([4, 5, 6, 7], 0), ([8, 9], 2)]):
        template = _zero12_state(torch.zeros(10), torch.zeros(10), 4, rank, 3)  # the fresh 3-rank engine's layout
        got = repartition(saved, template, rank, 3)
        assert got["single_partition_of_fp32_groups"][0].tolist() == weights
        assert got["group_paddings"] == [padding] and got["partition_count"] == [3]
        moments = got["base_optimizer_state"]["state"][0]
        assert moments["exp_avg"].tolist() == [-1.0 - w for w in weights] + [0.0] * padding  # padded, zeros
        assert float(moments["step"]) == 5.0 and got["loss_scale"] == 1.0


def test_partitions_that_do_not_fit_the_new_layout_are_refused():
    saved = [_zero12_state(torch.arange(10.0), torch.zeros(10), 6, r, 2) for r in range(2)]
    template = _zero12_state(torch.zeros(40), torch.zeros(40), 20, 0, 2)  # a model of 40 weights
    with pytest.raises(ValueError, match="param group 0: the saved partitions hold 10 weights"):
        repartition(saved, template, 0, 2)
