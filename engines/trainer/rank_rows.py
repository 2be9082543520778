"""An update batch spread over the ranks of a data-parallel group: which rows each rank holds, and the whole
batch gathered back from every rank's rows.

Slicing (train.num_ranks = N, an update batch of B rows in the scored shards' order, N dividing B):

    rank r holds rows [r * B/N, (r + 1) * B/N)     `rank_rows`; a contiguous block, so it reads only the
                                                    shard parts that hold it (stages/update_ranks.py)

Each rank runs the no-grad forward (old log-probs, values) on its rows only, padded to the widths of the
whole batch (the longest prompt and response on any rank: `agree_shape`, `pad_to`) and cut into the
micro-batches one rank cuts from the same rows when train.micro_batch_size divides B/N: the same inputs
in the same kernels, so the same numbers (up to rounding where a kernel picks another path, e.g. a forward
taken with grad for `_first_forward`). `gather_rows` then hands every rank all B rows with their
forward outputs (an all-gather per field; rank order is row order), and the trainer computes reward
shaping, KL, group baselines and advantage whitening over the whole batch on every rank from the very
numbers one rank has. None of those statistics is a sum of per-rank partial statistics, so none depends on
N (a group may straddle two ranks: its baseline is still taken over all its samples).

Why gather rather than keep each rank's rows to itself: every optimizer step of a shuffled epoch draws its
rows from the whole batch (the same steps as one rank takes), and rank r trains on the r-th contiguous 1/N
of each step (`step_share`), rows that other ranks read. What the gather moves to each rank, once per
update: 16 bytes per prompt token (int64 ids and mask) and 36 per response token (ids, mask, reference,
sampler and old log-probs, values), ~55 MB for 1,024 rows of 1,024 + 1,024 tokens; the forward passes it
saves are (N - 1)/N of the batch's.
"""

from __future__ import annotations

from dataclasses import fields
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from engines.trainer.experience import ExperienceBatch


def rank_rows(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s rows in an update batch of `total` rows.

    Raises ValueError naming both numbers when `world` does not divide `total` (every rank must hold as many
    rows: the ranks' forward passes and optimizer micro-steps are collectives under ZeRO-3).
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not a rank of a world of {world}")
    if total % world:
        raise ValueError(
            f"an update batch of {total} rows cannot be split evenly over train.num_ranks={world} ranks "
            f"(train.num_ranks must divide rollout.prompts_per_iteration * rollout.n_samples)"
        )
    share = total // world
    return rank * share, (rank + 1) * share


def step_share(rows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of one optimizer step: the r-th contiguous 1/world of the step's rows, (S,) -> (S/world,).

    With the first epoch's unshuffled single step (rows = arange(B)) that is exactly the rank's own rows,
    whose forward it has taken already (PPOTrainer._first_forward). Raises ValueError when `world` does not
    divide the step (the config refuses such a train.num_ranks before any work).
    """
    if len(rows) % world:
        raise ValueError(f"an optimizer step of {len(rows)} rows cannot be shared by train.num_ranks={world} ranks")
    share = len(rows) // world
    return rows[rank * share : (rank + 1) * share]


class BatchShape(NamedTuple):
    """The whole update batch: rows (all ranks), prompt_width P and response_width R (the widest on any rank)."""

    rows: int
    prompt_width: int
    response_width: int


def agree_shape(local: ExperienceBatch, world: int) -> BatchShape:
    """The whole batch's shape from every rank's rows (one small all-gather; none with one rank).

    Raises ValueError, on every rank alike (each sees every rank's numbers), when the ranks hold different
    numbers of rows, or when some have rollout log-probs or finish reasons and others not.
    """
    has = (local.rollout_logprobs is not None, local.truncated is not None, local.policy_mask is not None)
    mine = [len(local), local.prompt_ids.shape[1], local.response_ids.shape[1], *has]
    if world == 1:
        return BatchShape(*mine[:3])
    import torch.distributed as dist

    sent = torch.tensor(mine, dtype=torch.long, device=local.scores.device)
    received = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(received, sent)
    per_rank = [t.tolist() for t in received]
    rows = [r[0] for r in per_rank]
    if len(set(rows)) > 1:
        raise ValueError(f"the update ranks hold {rows} rows (rank 0 first): every rank needs the same number")
    flags = {tuple(r[3:]) for r in per_rank}
    if len(flags) > 1:
        raise ValueError(
            f"the update ranks disagree on which fields their rows carry ((rollout_logprobs, finish reasons, "
            f"token owners) "
            f"per rank: {[tuple(bool(x) for x in r[3:]) for r in per_rank]})"
        )
    return BatchShape(sum(rows), max(r[1] for r in per_rank), max(r[2] for r in per_rank))


def pad_to(batch: ExperienceBatch, prompt_width: int, response_width: int, pad_token_id: int) -> ExperienceBatch:
    """`batch` with its prompts left-padded to `prompt_width` columns and its responses right-padded to
    `response_width` (ids with `pad_token_id`, masks and per-token floats with 0), as ExperienceBatch.from_lists
    pads the whole batch. Raises ValueError when the batch is wider already."""
    grow_p = prompt_width - batch.prompt_ids.shape[1]
    grow_r = response_width - batch.response_ids.shape[1]
    if grow_p < 0 or grow_r < 0:
        raise ValueError(
            f"cannot pad a batch of widths ({batch.prompt_ids.shape[1]}, {batch.response_ids.shape[1]}) "
            f"to ({prompt_width}, {response_width})"
        )
    if grow_p == 0 and grow_r == 0:
        return batch

    def right(t: Optional[torch.Tensor], value) -> Optional[torch.Tensor]:
        return None if t is None else F.pad(t, (0, grow_r), value=value)

    return ExperienceBatch(
        prompt_ids=F.pad(batch.prompt_ids, (grow_p, 0), value=pad_token_id),
        prompt_mask=F.pad(batch.prompt_mask, (grow_p, 0), value=0),
        response_ids=right(batch.response_ids, pad_token_id),
        response_mask=right(batch.response_mask, 0.0),
        scores=batch.scores,
        ref_logprobs=right(batch.ref_logprobs, 0.0),
        rollout_logprobs=right(batch.rollout_logprobs, 0.0),
        group_ids=batch.group_ids,
        truncated=batch.truncated,
        policy_mask=right(batch.policy_mask, 0.0),
    )


def _all_gather_rows(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """(b, ...) on every rank -> (world * b, ...) concatenated in rank order on every rank (equal shapes)."""
    import torch.distributed as dist

    sent = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
    received = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(received, sent)
    whole = torch.cat(received)
    return whole.bool() if tensor.dtype == torch.bool else whole


def gather_rows(
    local: ExperienceBatch, old_logprobs: torch.Tensor, values: Optional[torch.Tensor], world: int
) -> tuple[ExperienceBatch, torch.Tensor, Optional[torch.Tensor]]:
    """Every rank's rows, padded to the agreed widths (`pad_to`), with their (b, R) old log-probs and values
    (None without a critic, on every rank) -> the whole batch (B, ...) and its (B, R) old log-probs and values,
    rows in rank order: the update batch's own order. As they are with one rank."""
    if world == 1:
        return local, old_logprobs, values
    gathered = {}
    for f in fields(local):
        value = getattr(local, f.name)
        gathered[f.name] = None if value is None else _all_gather_rows(value, world)
    whole_values = _all_gather_rows(values, world) if values is not None else None
    return ExperienceBatch(**gathered), _all_gather_rows(old_logprobs, world), whole_values
