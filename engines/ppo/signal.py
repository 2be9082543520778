"""How much of a batch carries a learning signal: the share of prompt groups whose rewards differ, and the share
of samples whose advantage is not zero.

    signal_metrics(scores, group_ids, advantages, mask) -> {"signal/group_spread", "signal/nonzero_advantage"}

Why: a group estimator (GRPO, RLOO, Dr. GRPO) gives every sample of a group whose rewards are all equal an
advantage of exactly 0 (engines/ppo/advantages.group_advantages), so such a group teaches nothing. On a task
harder than the model (3% of samples correct, 4 samples per prompt) almost every group is all-wrong and the update
is noise plus the KL term; these two numbers say so, per iteration, in the metrics and the terminal table.

- signal/group_spread: groups (rows sharing a group id) with max(score) != min(score), over all groups with two
  samples or more; absent when no group has two samples (PPO with one sample per prompt: nothing to compare).
- signal/nonzero_advantage: samples with any trained token whose advantage is not 0, over all samples. With
  algo.kl_in_reward the KL term makes almost every advantage non-zero: then it measures that, not the reward.

Scores are what the advantages saw (after reward shaping), so the two agree: under a group estimator without KL in
the reward, nonzero_advantage = the share of samples in groups with spread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def signal_metrics(scores: Tensor, group_ids: Sequence[int], advantages: Tensor, mask: Tensor) -> dict[str, float]:
    """The batch's signal shares (module docstring).

    scores: (B,) per-sample scores; group_ids: B ints, equal for the samples of one draw of a prompt;
    advantages: (B, T) per-token advantages; mask: (B, T), True/1 where the token is trained.
    Raises ValueError when the lengths disagree or B is 0.
    """
    rows = scores.shape[0]
    if rows == 0 or len(group_ids) != rows or advantages.shape[0] != rows or mask.shape != advantages.shape:
        raise ValueError(
            f"signal_metrics: {rows} scores, {len(group_ids)} group ids, advantages {tuple(advantages.shape)}, "
            f"mask {tuple(mask.shape)}: need B > 0 rows in each and advantages shaped like the mask"
        )
    groups: dict[int, list[float]] = {}
    for group, score in zip(group_ids, scores.tolist()):
        groups.setdefault(group, []).append(score)
    comparable = [g for g in groups.values() if len(g) >= 2]
    metrics: dict[str, float] = {}
    if comparable:
        metrics["signal/group_spread"] = sum(max(g) != min(g) for g in comparable) / len(comparable)
    nonzero = ((advantages != 0) & mask.bool()).any(dim=1)
    metrics["signal/nonzero_advantage"] = float(nonzero.to(torch.float64).mean())
    return metrics
