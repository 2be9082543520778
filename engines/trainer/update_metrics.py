"""What an update reports (engines/trainer/ppo_trainer.py): UpdateResult, and the metrics of its batch, each a
measured value or absent.

    batch_metrics(batch, old_logprobs, values, adv, kl_mean, kl_coef)   reward, KL, lengths, advantages, returns, values
    sampler_gap_metric(batch, old_logprobs)                             rollout/logprob_abs_diff, or {} without
                                                                        the sampler's log-probs

batch: the whole update batch (B rows, R response columns) after the ranks' rows were gathered; old_logprobs and
values: [B, R] float32 (values None without a critic); adv: the estimator's advantages and returns, [B, R] each.
Token means are over the batch's trained mask (the policy's own tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engines.ppo.masked import masked_mean
from engines.trainer.experience import ExperienceBatch


@dataclass
class UpdateResult:
    """metrics: namespaced floats. The lists are per sample, each of its response length (no padding)."""

    metrics: dict[str, float]
    old_logprobs: list[list[float]]
    values: list[list[float]]
    advantages: list[list[float]]
    returns: list[list[float]]


def ragged(tensor: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """(B, R) values of right-padded rows -> each row's first mask.sum() values (one tolist, not one per row)."""
    lengths = mask.sum(dim=1).long().tolist()
    return [row[:n] for row, n in zip(tensor.tolist(), lengths)]


def batch_metrics(
    batch: ExperienceBatch,
    old_logprobs: torch.Tensor,
    values: Optional[torch.Tensor],
    adv,
    kl_mean: float,
    kl_coef: float,
) -> dict[str, float]:
    mask = batch.trained_mask
    metrics = {
        "reward/mean": float(batch.scores.mean()),
        "kl/mean": kl_mean,
        "kl/coef": kl_coef,
        "response/length_mean": float(batch.response_mask.sum(dim=1).mean()),
        "advantages/mean": float(masked_mean(adv.advantages, mask)),
        "returns/mean": float(masked_mean(adv.returns, mask)),
    }
    if len(batch) > 1:  # one sample has no spread (std would be NaN; 0 would be made up)
        metrics["reward/std"] = float(batch.scores.std())
    if batch.policy_mask is not None:  # multi-turn: how much of a conversation the policy wrote
        metrics["response/policy_tokens_mean"] = float(mask.sum(dim=1).mean())
    if batch.truncated is not None:
        metrics["response/truncated_fraction"] = float(batch.truncated.float().mean())
    if values is not None:
        metrics["values/mean"] = float(masked_mean(values, mask))
    return metrics


def sampler_gap_metric(batch: ExperienceBatch, old_logprobs: torch.Tensor) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's for the same weights (should be ~0); {} when the rows
    carry no sampler log-probs. Not called when the old log-probs are the sampler's (the same tensor)."""
    if batch.rollout_logprobs is None:
        return {}
    return {
        "rollout/logprob_abs_diff": float(
            masked_mean((batch.rollout_logprobs - old_logprobs).abs(), batch.trained_mask)
        )
    }
