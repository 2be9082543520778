"""The old log-probs of the update's first optimizer step, taken from that step's own forwards.

With several optimizer steps per update (train.train_batch_size below the update batch, as in the README recipe:
64 rows, 2 steps of 32), stage 1's no-grad pass ran the actor over every row, and the first step then ran it again
over its own rows before any weight moved: the same log-probs computed twice, a quarter of the update's FLOPs on
those rows (a forward of the 4 a forward-backward-plus-old-pass costs). When nothing before the first step needs
them, the pass runs over the other steps' rows only, and each micro-batch of the first step writes its own
forward's detached log-probs into the old ones before its loss reads them (`LossSteps._optimizer_step`,
fill_old=True).

Nothing before the first step needs them when: the old log-probs are the trainer's (algo.old_logprobs =
recompute), no critic (algo "ppo" needs old values for its advantages), the KL is not folded into the reward
(algo.kl_in_reward false: the token rewards would hold it), and one rank (the rows of a step are split over ranks
after the gather). PPOTrainer._old_pass asks only when the first epoch is not already the single-forward case
(ppo_trainer._old_from_first_forward), which needs no pass at all.

What changes: the first step's old log-probs are its forward's, so its ratio pi/pi_old is exactly 1, where the
separate pass made it 1 up to float summation order (the pass ran the rows in other micro-batches). On the README
recipe's third iteration the two are equal to the bit (64 rows: max |difference| 0.0). The KL metrics, the mismatch
gate's figures and the per-token old log-probs of the result are computed after the steps from the same (B, R)
tensor, whole by then.

    defers_old(trainer) -> bool
    first_step_rows(trainer, group_ids) -> (S,) sorted indices of epoch 0's first step
    old_except(trainer, local, pending) -> (B, R) old log-probs, NaN on the `pending` rows until their step fills them
"""

from __future__ import annotations

import torch

from engines.trainer.experience import ExperienceBatch


def defers_old(trainer) -> bool:
    """Whether this trainer's updates take their first step's old log-probs from that step's forwards (module
    docstring)."""
    return (
        not trainer._old_from_rollout
        and trainer.critic is None
        and not trainer.cfg.algo.kl_in_reward
        and trainer.actor.world_size == 1
    )


def first_step_rows(trainer, group_ids: torch.Tensor) -> torch.Tensor:
    """(S,) the rows, sorted, of epoch 0's first optimizer step over an update batch with these (B,) group ids:
    the first train_batch_size of the epoch's shuffle, as PPOTrainer._epochs draws it."""
    return trainer._epoch_order(0, group_ids)[: trainer.train_batch_size].sort().values


def old_except(trainer, local: ExperienceBatch, pending: torch.Tensor) -> torch.Tensor:
    """(B, R) float32 old log-probs of `local`'s rows from a no-grad pass over the rows not in `pending` (kept in
    order, so a group's samples share micro-batches as in the full pass); NaN on the `pending` rows."""
    old = torch.full(local.response_mask.shape, float("nan"), dtype=torch.float32, device=local.response_mask.device)
    keep = torch.ones(len(local), dtype=torch.bool)
    keep[pending] = False
    rest = torch.nonzero(keep).flatten()
    if len(rest):
        logprobs, _ = trainer._old_logprobs_and_values(local.select(rest.to(old.device)))
        old[rest.to(old.device)] = logprobs
    return old
