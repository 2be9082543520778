"""The train/inference mismatch: how far the sampler's log-probs are from the trainer's for the same tokens.

    mismatch_sums(sampler_logprobs, trainer_logprobs, mask) -> MismatchSums    per-rank sums (add them over ranks)
    mismatch_metrics(sums) -> {"mismatch/logprob_abs_diff_mean", "..._max", "mismatch/kl", "mismatch/tokens"}

Notation: s_t = log pi_sampler(y_t), t_t = log pi_trainer(y_t) for a token y_t the sampler drew, d_t = t_t - s_t.
    logprob_abs_diff_mean = sum |d_t| / N,  logprob_abs_diff_max = max |d_t|   over the N masked tokens
    kl = sum k3(d_t) / N,  k3(d) = exp(d) - 1 - d >= 0
k3 is Schulman's estimator of KL(pi_sampler || pi_trainer) from samples of pi_sampler (E[exp(d)] = 1 there): unbiased
and never negative, where the plain mean of -d can cancel. For the same weights both are rounding (float32: ~1e-6);
a skipped reload, another dtype or a stale kernel makes them large.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: a wildly different token counts as huge, not as inf


class MismatchSums(NamedTuple):
    """Sums over one rank's masked tokens: sum |d|, sum k3(d), max |d| (0 without tokens), token count."""

    abs_sum: float
    kl_sum: float
    abs_max: float
    tokens: float


def mismatch_sums(sampler_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> MismatchSums:
    """sampler_logprobs, trainer_logprobs: (B, T) per-token log-probs of the same response tokens; mask (B, T), 1 = a
    policy token that counts (padding and environment tokens 0). ValueError when the shapes differ."""
    if not sampler_logprobs.shape == trainer_logprobs.shape == mask.shape:
        raise ValueError(
            f"mismatch: sampler {tuple(sampler_logprobs.shape)}, trainer {tuple(trainer_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} log-probs must have one (B, T) shape"
        )
    keep = mask.bool()
    d = (trainer_logprobs.float() - sampler_logprobs.float())[keep].clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if d.numel() == 0:
        return MismatchSums(0.0, 0.0, 0.0, 0.0)
    k3 = torch.expm1(d) - d  # exp(d) - 1 - d, without the cancellation of exp(d) - 1 near d = 0
    return MismatchSums(float(d.abs().sum()), float(k3.sum()), float(d.abs().max()), float(d.numel()))


def mismatch_metrics(sums: MismatchSums) -> dict[str, float]:
    """The mismatch/* metrics of summed MismatchSums; {} without tokens (nothing was measured)."""
    if sums.tokens == 0:
        return {}
    return {
        "mismatch/logprob_abs_diff_mean": sums.abs_sum / sums.tokens,
        "mismatch/logprob_abs_diff_max": sums.abs_max,
        "mismatch/kl": sums.kl_sum / sums.tokens,
        "mismatch/tokens": sums.tokens,
    }
