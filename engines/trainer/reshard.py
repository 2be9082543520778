"""Resuming a trainer on another number of ranks than the run that saved it (train.num_ranks changed).

ppoflow's optimizer files (engines/trainer/checkpoint.py) are each rank's DeepSpeed optimizer `state_dict()` in
safetensors + JSON. DeepSpeed's universal checkpoint (deepspeed.checkpoint.ds_to_universal) converts DeepSpeed's
own checkpoint folders (its `mp_rank_*` / `zero_pp_rank_*` torch.save files), which ppoflow does not write (no
pickle in storage), so it cannot read these. What carries over instead, by ZeRO stage (the same on both sides):

    stage 0, float32   torch's AdamW as it is: the whole state on every rank, equal across ranks. Every rank
                       loads saved rank 0's file.
    stage 1 and 2      each rank's file holds its partition of each parameter group's flat fp32 weights
                       (`single_partition_of_fp32_groups`, saved without padding) and AdamW moments (padded).
                       The flat group is the parameters back to back in model order whatever the rank count;
                       only its end padding (to a multiple of 2 x ranks) and its cut into equal partitions depend
                       on the count. `repartition` joins the saved partitions in rank order, drops their padding,
                       pads for the new count and cuts out this rank's partition; the normal load then takes it.
    stage 3            refused: ZeRO-3 partitions every parameter on its own, in sub-groups (not done here).
    stage 0, bf16/fp16 refused: DeepSpeed's mixed-precision optimizer keeps fp32 copies of its own.

RNG: rank r resumes saved rank (r mod the saved count)'s RNG state (checkpoint.load_trainer_state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

# DeepSpeed's state_dict keys (deepspeed.checkpoint.constants)
BASE = "base_optimizer_state"
FP32 = "single_partition_of_fp32_groups"
PADDINGS = "group_paddings"
PARTITIONS = "partition_count"

REPLICATED = "replicated"
PARTITIONED = "partitioned"


def other_count_mode(state_dir: str | Path, cfg) -> Optional[str]:
    """How the trainer state in `state_dir` loads on another number of ranks under the run config `cfg`:
    REPLICATED, PARTITIONED (see the module docstring), or None (it cannot; also when the folder has no
    config.json saying how it was trained)."""
    saved_path = Path(state_dir) / "config.json"
    if not saved_path.is_file():
        return None
    saved, run = json.loads(saved_path.read_text()), cfg.model_dump(mode="json")
    stage = int(run["train"]["zero_stage"])
    if int(saved["train"]["zero_stage"]) != stage:
        return None
    if stage == 0:
        return REPLICATED if saved["model"]["dtype"] == run["model"]["dtype"] == "float32" else None
    return PARTITIONED if stage in (1, 2) else None


def _cut(flat: torch.Tensor, size: int, rank: int, world: int) -> torch.Tensor:
    """Partition `rank` of `world` equal partitions of `size` elements of the 1-D `flat`, zero-padded at its end."""
    padded = F.pad(flat, (0, size * world - flat.numel()))
    return padded[rank * size : (rank + 1) * size].clone()


def repartition(saved: list[dict[str, Any]], template: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's ZeRO-1/2 optimizer state for a world of `world` ranks, from every saved rank's state (rank
    order) and the freshly built engine's own `state_dict()` (`template`: the new partition sizes and paddings).

    Per parameter group i: a saved rank's partition is its fp32 weights (saved unpadded) and its AdamW moments
    (padded by that rank's `group_paddings[i]`, non-zero on the last rank only). Joined in rank order without
    padding they are the group's flat tensor, which is cut again into partitions of the new size. Non-partition
    values (the step count, hyperparameters, loss scale) are saved rank 0's. Raises ValueError naming the group
    when the saved partitions do not add up to the new layout's parameter count.
    """
    out = dict(saved[0])
    base = saved[0][BASE]
    state: dict[int, dict[str, Any]] = {}
    fp32 = []
    for i, group in enumerate(base["param_groups"]):
        new_padding = int(template[PADDINGS][i])
        size = template[FP32][i].numel() + new_padding  # the new partition's length, padding included
        weights = torch.cat([sd[FP32][i].reshape(-1) for sd in saved])
        if not size * (world - 1) <= weights.numel() <= size * world:  # DeepSpeed pads the last rank only
            raise ValueError(
                f"optimizer param group {i}: the saved partitions hold {weights.numel()} weights, which "
                f"{world} partitions of {size} cannot hold (was the model or train.zero_stage changed?)"
            )
        fp32.append(_cut(weights, size, rank, world)[: size - new_padding])
        pid = group["params"][0]
        moments = {}
        for key, value in base["state"].get(pid, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                pieces = [sd[BASE]["state"][pid][key].reshape(-1) for sd in saved]
                pieces = [p[: p.numel() - int(sd[PADDINGS][i])] for p, sd in zip(pieces, saved)]
                moments[key] = _cut(torch.cat(pieces), size, rank, world)
            else:
                moments[key] = value
        state[pid] = moments
    out[BASE] = {"state": state, "param_groups": base["param_groups"]}
    out[FP32] = fp32
    out[PADDINGS] = list(template[PADDINGS])
    out[PARTITIONS] = template.get(PARTITIONS, out.get(PARTITIONS))
    return out
