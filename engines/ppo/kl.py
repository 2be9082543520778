"""Per-token estimators of KL(pi_theta || pi_ref) from log-probs of tokens sampled from pi_theta.

Notation (Schulman, "Approximating KL divergence", 2020): for a sampled token y,
    log_ratio = log pi_theta(y) - log pi_ref(y)            Shape (B, T)
    k1 = log_ratio                                          unbiased, can be negative per token
    k2 = 0.5 * log_ratio^2                                  biased, >= 0, low variance
    k3 = exp(-log_ratio) - (-log_ratio) - 1                 unbiased, >= 0 (x - 1 - log x with x = p_ref/p)

Padding positions are computed like the others; the caller masks them (response mask, 1 = response
token) -- token_level_rewards and aggregate both do.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import Tensor

from engines.ppo._checks import check_rank, check_same_shape

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k1", clamp: Optional[float] = 10.0
) -> Tensor:
    """Per-token KL estimate between the policy and the reference.

    Args:
        logprobs: Shape (B, T), log pi_theta of the sampled tokens (the policy that sampled them).
        ref_logprobs: Shape (B, T), log pi_ref of the same tokens.
        estimator: "k1", "k2" or "k3" (see the module docstring).
        clamp: the log-ratio is clamped to [-clamp, clamp] before any estimator; None = no clamp.
            Why: k3 exponentiates the log-ratio, and one token the reference finds near-impossible
            (ref log-prob -60 after a tokenizer mismatch or a fp16 underflow) gives exp(60) = 1e26,
            which swamps the whole batch's reward. exp(10) = 2.2e4 still penalises hard. The same
            clamp keeps k1/k2 on the same scale so switching estimators does not change the range.

    Returns:
        Shape (B, T), same dtype as logprobs. Gradients flow through logprobs (and ref_logprobs if it
        requires grad); the clamp stops gradients where it binds.

    Raises:
        ValueError for an unknown estimator, clamp <= 0, or mismatched shapes.
    """
    check_rank("logprobs", logprobs, 2, "(B, T)")
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be > 0 or None, got {clamp!r}")
    log_ratio = logprobs - ref_logprobs
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    # k3 with x = pi_ref / pi_theta: x - 1 - log x, written in the log domain.
    neg_log_ratio = -log_ratio
    return torch.expm1(neg_log_ratio) - neg_log_ratio
