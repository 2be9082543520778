"""The scalar reward the advantages see: running normalisation, then DAPO's overlong penalty.

    shaped = normalize(reward) + overlong_penalty(|y|)

Order (a choice; the papers do not combine them): the running statistics describe the reward sources'
output alone, not a mix with the length penalty, and the penalty keeps the size the user configured
(`reward.overlong.penalty`) whatever the scale of the source rewards.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from engines.ppo._checks import check_batch_of_rows, check_rank
from engines.ppo.reward_norm import RunningMoments
from engines.ppo.rewards import overlong_penalty


def shape_scores(
    scores: Tensor,
    response_mask: Tensor,
    normalizer: Optional[RunningMoments] = None,
    overlong: Optional[tuple[int, float]] = None,
    max_new_tokens: Optional[int] = None,
) -> tuple[Tensor, dict[str, float]]:
    """Shaped scores (B,) and their metrics.

    Args:
        scores: Shape (B,), the reward sources' scalar reward.
        response_mask: Shape (B, T), 1 = response token; a row's length is its count of 1s.
        normalizer: merged with this batch, then used to normalise it (updated in place); None = off.
        overlong: (buffer, penalty) of reward.overlong; None = off. Needs max_new_tokens.

    Returns:
        (scores (B,), metrics): reward/running_mean and reward/running_std (after the merge) with a
        normalizer; reward/overlong_penalty_mean (mean over the batch, <= 0) with overlong. No key for what
        is off.
    """
    check_rank("response_mask", response_mask, 2, "(B, T)")
    check_batch_of_rows("scores", scores, "response_mask", response_mask)
    metrics: dict[str, float] = {}
    if normalizer is not None:
        normalizer.update(scores)
        scores = normalizer.normalize(scores)
        metrics.update({"reward/running_mean": normalizer.mean, "reward/running_std": normalizer.std})
    if overlong is not None:
        if max_new_tokens is None:
            raise ValueError("shape_scores: overlong needs max_new_tokens (rollout.max_new_tokens)")
        penalty = overlong_penalty(response_mask.sum(dim=-1), max_new_tokens, *overlong)
        scores = scores + penalty.to(scores.dtype)
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
    return scores, metrics
