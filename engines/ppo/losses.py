"""PPO losses: clipped policy surrogate, clipped value loss, entropy and KL terms, and their aggregation.

Notation: B = sequences in this micro-batch, T = positions, m = response_mask (1 = response token,
0 = padding). ratio = exp(logp - old_logp) per token. A = advantages, R = returns.

Aggregation over the optimizer step (why `num_tokens`): with gradient accumulation or data-parallel
ranks, each micro-batch's loss is summed (DeepSpeed averages over ranks and accumulation steps, so
pass num_tokens = global tokens / (ranks * accumulation steps) there, or scale accordingly). Dividing
each micro-batch by ITS OWN token count weights a token in a short micro-batch more than one in a
long one; dividing every micro-batch by the token count of the whole step makes the summed loss
exactly the full-batch token mean, so how the batch is split does not change the gradient.

The total actor loss a trainer minimises is typically
    policy_loss(...).loss + entropy_coef * entropy_loss(entropy, m) + kl_coef * kl_loss(...)
with entropy from logprobs.entropy_from_logits and the KL term only when the KL is not in the reward.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional

import torch
from torch import Tensor

from engines.ppo._checks import check_rank, check_same_shape
from engines.ppo.kl import KLEstimator, kl_penalty
from engines.ppo.masked import masked_mean, masked_sum
from ppoflow.algorithms import AGG_MODES

AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]  # = AGG_MODES
# exp(20) = 4.9e8 is far outside any clip range, so where this binds the clipped branch already
# decides the loss; it only stops exp() overflowing to inf and inf * 0 = NaN gradients (as veRL does).
_MAX_LOG_RATIO = 20.0


class PolicyLossOutput(NamedTuple):
    """loss: scalar to minimise (has grad). clipfrac, approx_kl, ratio_mean: detached scalar metrics."""

    loss: Tensor
    clipfrac: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor


class ValueLossOutput(NamedTuple):
    """loss: scalar to minimise (has grad). clipfrac: detached scalar, share of tokens the clip bound."""

    loss: Tensor
    clipfrac: Tensor


def _positive(name: str, value: Optional[float]) -> float:
    if value is None or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


class StepNorm(NamedTuple):
    """The denominators of one optimizer step, passed to aggregate for each of its micro-batches.

    num_tokens: response tokens of the whole step; num_seqs: responses of the whole step with at least one
    counted token (a sample masked out of the loss, train.mask_truncated, is not a response of the step);
    max_len: Dr. GRPO's constant (a float; `algo.loss_agg_norm`, default rollout.max_new_tokens).
    """

    num_tokens: float
    num_seqs: float
    max_len: float


def step_norm(step_mask: Tensor, max_len: float) -> StepNorm:
    """StepNorm of one optimizer step from the loss mask of ALL its rows. Shape: step_mask (B_step, T).

    With these denominators every mode of `aggregate` is a sum over rows (token_mean: of masked token
    sums / num_tokens; seq_mean_token_mean: of row token means / num_seqs; seq_mean_token_sum_norm: of
    masked token sums / (num_seqs * max_len)), so the micro-batch losses of a step add up to the loss of
    the whole step's batch at once, however the rows are split and padded. num_tokens and num_seqs are
    at least 1 (a step whose rows are all masked has loss 0). ValueError when max_len <= 0.
    """
    check_rank("step_mask", step_mask, 2, "(B, T)")
    counted = step_mask != 0
    return StepNorm(
        float(counted.sum().clamp(min=1)), float(counted.any(dim=-1).sum().clamp(min=1)), _positive("max_len", max_len)
    )


def truncated_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, cap: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated importance sampling (TIS) weights for the sampler/trainer log-prob mismatch.

    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training": the tokens
    were sampled by the inference engine's policy pi_sampler (vLLM kernels), but PPO's ratio is taken
    against the trainer's pi_old (same weights, training kernels). The policy-gradient term of each token
    is multiplied by the detached weight
        w_t = min(pi_old(y_t) / pi_sampler(y_t), C) = min(exp(old_logprobs_t - rollout_logprobs_t), C)
    i.e. loss_t = w_t * max(-A_t * ratio_t, -A_t * clip(ratio_t)), as veRL (`tis_imp_ratio_cap`) and
    OpenRLHF (`vllm_is_truncated_threshold`) apply it. Truncating at C bounds the variance.

    Args:
        old_logprobs: Shape (B, T), the trainer's log-probs before the update (no grad).
        rollout_logprobs: Shape (B, T), the sampler's log-probs of the same tokens.
        response_mask: Shape (B, T), 1 = response token.
        cap: C >= 1 (a cap below 1 would cut on-policy tokens' weight 1).

    Returns:
        (weights (B, T) detached, 0 at padding; weight_mean = masked mean of the truncated weights;
        clipfrac = share of response tokens whose raw weight exceeded C).

    Raises:
        ValueError for shape mismatch or cap < 1.
    """
    check_rank("old_logprobs", old_logprobs, 2, "(B, T)")
    check_same_shape("old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    if not cap >= 1.0:
        raise ValueError(f"algo.tis_cap must be >= 1, got {cap!r}")
    with torch.no_grad():
        log_weight = (old_logprobs.float() - rollout_logprobs.float()).clamp(max=_MAX_LOG_RATIO)
        raw = torch.exp(log_weight)
        weights = torch.where(response_mask != 0, raw.clamp(max=cap), torch.zeros_like(raw))
        return weights, masked_mean(weights, response_mask), masked_mean((raw > cap).float(), response_mask)


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: AggMode = "token_mean",
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    max_len: Optional[int] = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss: Shape (B, T). mask: Shape (B, T), 1 = the token counts.
        mode:
            token_mean:              sum(loss * m) / num_tokens; num_tokens defaults to m.sum() of this
                                     batch. Pass the response tokens of the WHOLE optimizer step so that
                                     summing micro-batch losses gives the full-batch mean.
            seq_mean_token_mean:     mean over sequences of each sequence's token mean; the sum of
                                     sequence means is divided by num_seqs (default B). Empty rows add 0.
            seq_mean_token_sum_norm: sum(loss * m) / (num_seqs * max_len) (Dr. GRPO): every token weighs
                                     the same and no length normalisation; max_len defaults to T but
                                     should be the constant generation budget (max_new_tokens) so
                                     micro-batches with different padding agree.
        num_tokens, num_seqs, max_len: step-wide denominators (> 0), see above.

    Returns:
        A 0-dim tensor; 0 (with grad) when nothing is counted and no denominator was given.

    Raises:
        ValueError for an unknown mode, shape mismatch, or a denominator <= 0.
    """
    check_rank("loss", loss, 2, "(B, T)")
    check_same_shape("loss", loss, mask=mask)
    if mode not in AGG_MODES:
        raise ValueError(f"agg_mode must be one of {AGG_MODES}, got {mode!r}")
    if mode == "token_mean":
        denominator = (mask != 0).sum().clamp(min=1) if num_tokens is None else _positive("num_tokens", num_tokens)
        return masked_sum(loss, mask) / denominator
    seqs = loss.shape[0] if num_seqs is None else _positive("num_seqs", num_seqs)
    if mode == "seq_mean_token_mean":
        return masked_mean(loss, mask, dim=-1).sum() / max(seqs, 1)
    length = loss.shape[1] if max_len is None else _positive("max_len", max_len)
    return masked_sum(loss, mask) / (max(seqs, 1) * max(length, 1))  # seq_mean_token_sum_norm


class Aggregation(NamedTuple):
    """How each loss term below reduces to a scalar: the keywords they all take after their own, passed on to
    `aggregate` (which documents them). A trainer builds them once per step, e.g. from its StepNorm:
    `Aggregation(mode, *norm)._asdict()`."""

    agg_mode: AggMode = "token_mean"
    num_tokens: Optional[float] = None
    num_seqs: Optional[float] = None
    max_len: Optional[float] = None

    def __call__(self, loss: Tensor, mask: Tensor) -> Tensor:
        """aggregate(loss, mask, ...) with these settings. Shapes: loss, mask (B, T)."""
        return aggregate(loss, mask, *self)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = None,
    token_weights: Optional[Tensor] = None,
    **agg,
) -> PolicyLossOutput:
    """PPO's clipped surrogate, per token: max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)).

    Args:
        logprobs: Shape (B, T), current policy log-probs (with grad).
        old_logprobs: Shape (B, T), log-probs of the policy that the advantages belong to (no grad).
        advantages: Shape (B, T). response_mask: Shape (B, T), 1 = response token.
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high]; clip_low in [0, 1),
            clip_high >= 0 (clip_high > clip_low is DAPO's clip-higher).
        dual_clip: c > 1 (Ye et al. 2020): where A < 0 the per-token loss is capped at -c * A, so a huge
            ratio on a bad token cannot dominate the batch. None = off.
        token_weights: Shape (B, T), detached per-token weights multiplying the clipped loss before
            aggregation (truncated_is_weights); None = all 1.
        agg: Aggregation's fields (agg_mode, num_tokens, num_seqs, max_len), see aggregate.

    Returns:
        PolicyLossOutput. Metrics are plain masked means over THIS batch's response tokens:
        clipfrac = share of tokens where the clipped branch is the larger loss (the gradient is cut);
        approx_kl = mean of (ratio - 1) - log ratio, Schulman's k3 estimate of KL(pi_old || pi_theta)
        from tokens sampled by pi_old: unbiased and never negative, unlike mean(-log ratio);
        ratio_mean = mean ratio.

    Raises:
        ValueError for shape mismatch, clip_low outside [0, 1), clip_high < 0, dual_clip <= 1;
        TypeError for a keyword that is not an Aggregation field.
    """
    reduce = Aggregation(**agg)
    check_rank("logprobs", logprobs, 2, "(B, T)")
    check_same_shape(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip!r}")
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        capped = torch.minimum(per_token, -dual_clip * advantages)
        per_token = torch.where(advantages < 0, capped, per_token)
    if token_weights is not None:
        check_same_shape("logprobs", logprobs, token_weights=token_weights)
        per_token = per_token * token_weights.detach()
    loss = reduce(per_token, response_mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
        approx_kl = masked_mean(torch.expm1(log_ratio) - log_ratio, response_mask)
        ratio_mean = masked_mean(ratio, response_mask)
    return PolicyLossOutput(loss, clipfrac, approx_kl, ratio_mean)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    value_clip: Optional[float] = 0.5,
    **agg,
) -> ValueLossOutput:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, +-c).

    Args:
        values: Shape (B, T), current critic values (with grad).
        old_values: Shape (B, T), the critic's values at rollout time. returns: Shape (B, T), targets.
        response_mask: Shape (B, T), 1 = response token.
        value_clip: c > 0, or None for the plain 0.5 * (V - R)^2.
        agg: Aggregation's fields (agg_mode, num_tokens, num_seqs, max_len), see aggregate.

    Returns:
        ValueLossOutput(loss, clipfrac = share of response tokens where the clipped error is larger,
        i.e. where the clip cuts the gradient; 0 without value_clip).

    Raises:
        ValueError for shape mismatch or value_clip <= 0; TypeError for a keyword that is not an Aggregation field.
    """
    reduce = Aggregation(**agg)
    check_rank("values", values, 2, "(B, T)")
    check_same_shape("values", values, old_values=old_values, returns=returns, response_mask=response_mask)
    unclipped_error = (values - returns).square()
    if value_clip is None:
        per_token = 0.5 * unclipped_error
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        value_clip = _positive("value_clip", value_clip)
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_error = (clipped_values - returns).square()
        per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
        with torch.no_grad():
            clipfrac = masked_mean((clipped_error > unclipped_error).float(), response_mask)
    return ValueLossOutput(reduce(per_token, response_mask), clipfrac)


def entropy_loss(entropy: Tensor, response_mask: Tensor, **agg) -> Tensor:
    """-aggregate(entropy): adding entropy_coef * this to the loss rewards exploration (coef > 0).

    Shapes: entropy (B, T) from logprobs.entropy_from_logits, response_mask (B, T) 1 = response token.
    agg: Aggregation's fields. Returns a 0-dim tensor with grad through entropy. Log aggregate(entropy, ...)
    itself as the metric.
    """
    return -Aggregation(**agg)(entropy, response_mask)


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    estimator: KLEstimator = "k3",
    clamp: Optional[float] = 10.0,
    **agg,
) -> Tensor:
    """The KL to the reference as a loss term (GRPO style, when the KL is not in the reward).

    Shapes: logprobs (B, T) with grad, ref_logprobs (B, T), response_mask (B, T) 1 = response token.
    Returns aggregate(kl_penalty(logprobs, ref_logprobs, estimator, clamp)) (agg: Aggregation's fields); multiply
    by kl_coef.
    k3 is the usual choice here (unbiased and >= 0, so its gradient never pushes KL negative).
    """
    reduce = Aggregation(**agg)
    return reduce(kl_penalty(logprobs, ref_logprobs, estimator, clamp), response_mask)
