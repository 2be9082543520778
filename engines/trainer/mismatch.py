"""The trainer's side of the mismatch gate: its log-probs of the sampled tokens with the weights the update starts
from, against the sampler's (engines/ppo/mismatch.py for the math, stages/mismatch_gate.py for the gate).

Which trainer log-probs, by the update's path; none costs a forward of its own:
- the first epoch's own forward (one step of one micro-batch per rank): its log-probs, taken before any step;
- algo.old_logprobs = recompute: the old log-probs, the trainer's for exactly the sampler's weights;
- algo.old_logprobs = rollout otherwise: the forwards of the update's first optimizer step (all of its
  micro-batches run before the step moves a weight), over that step's rows (train.train_batch_size of them,
  drawn by the epoch's shuffle), collected by LossSteps._actor_micro_step.

    start_mismatch(trainer, local, old_logprobs, first) -> metrics, or None when the first step will measure
    first_step_mismatch(trainer) -> metrics                  after the update's steps, in that case
"""

from __future__ import annotations

from typing import Optional

import torch

from engines.ppo.mismatch import MismatchSums, mismatch_metrics, mismatch_sums
from engines.trainer.deepspeed_setup import sum_over_ranks


def start_mismatch(trainer, local, old_logprobs: Optional[torch.Tensor], first) -> Optional[dict[str, float]]:
    """mismatch/* of this update on every rank, or None after arming trainer.first_step_mismatch (module docstring).
    {} when the rows carry no rollout_logprobs. local: this rank's padded ExperienceBatch (b, R); old_logprobs: the
    trainer's (b, R) before the update, None when they are the sampler's; first: the first epoch's forward or None."""
    trainer.first_step_mismatch, trainer.first_step_sums = None, []
    if local.rollout_logprobs is None:
        return {}
    if first is not None:
        trainer_logprobs = first.policy.logprobs.detach().float()
    elif old_logprobs is not None:
        trainer_logprobs = old_logprobs
    else:
        trainer.first_step_mismatch = []
        return None
    sums = mismatch_sums(local.rollout_logprobs, trainer_logprobs, local.trained_mask)
    return mismatch_metrics(_over_ranks(sums, trainer.actor.world_size))


def first_step_mismatch(trainer) -> dict[str, float]:
    """mismatch/* of the micro-batches of the update's first step, over all ranks (every rank calls it)."""
    parts = list(trainer.first_step_sums)
    total = MismatchSums(
        sum(p.abs_sum for p in parts),
        sum(p.kl_sum for p in parts),
        max((p.abs_max for p in parts), default=0.0),
        sum(p.tokens for p in parts),
    )
    trainer.first_step_mismatch, trainer.first_step_sums = None, []
    return mismatch_metrics(_over_ranks(total, trainer.actor.world_size))


def _over_ranks(sums: MismatchSums, world: int) -> MismatchSums:
    """The sums of every rank, the max over them."""
    if world == 1:
        return sums
    import torch.distributed as dist

    added = sum_over_ranks({"abs": sums.abs_sum, "kl": sums.kl_sum, "tokens": sums.tokens}, world)
    largest = torch.tensor([sums.abs_max], dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return MismatchSums(added["abs"], added["kl"], float(largest[0]), added["tokens"])
