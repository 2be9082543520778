"""Advantages and returns: GAE with a critic, and the critic-free group / REINFORCE++ estimators.

Notation: B = sequences, T = positions of the (right-padded) response window, m = response_mask with
1 = response token, 0 = padding. r = token rewards (rewards.token_level_rewards), V = critic values,
s = scalar scores (B,), G = group size (samples per prompt; rows [k*G, (k+1)*G) share prompt k).
All outputs are 0 at padding. Advantages are training targets: inputs are detached.

compute_advantages, by algo (A = advantages, R = returns):
    ppo:                    A, R = GAE(token_rewards, values); R = A + values before whitening A.
    grpo / dr_grpo / rloo:  A_t = group_advantage(clip(s))_b + sum_{t' >= t} gamma^(t'-t) k_t'
                            where k = kl_token_rewards(...) is the KL part of token_rewards (0 when
                            the KL is in the loss, the GRPO default; OpenRLHF's shaping otherwise).
    reinforce_pp:           A = whiten(discounted_returns(token_rewards)) (KL folded in).
    reinforce_pp_baseline:  the score at the last token replaced by clip(s) - mean_g(clip(s)),
                            then discounted returns with the KL tokens, then whitened.
    Critic-free algos have no value target: R = A before whitening (the discounted return for
    REINFORCE++); the trainer logs R but trains no critic on it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from engines.ppo._checks import check_batch_of_rows, check_rank, check_same_shape
from engines.ppo.masked import masked_mean, masked_var
from engines.ppo.rewards import clip_scores, last_response_index
from ppoflow.algorithms import ALGO_NAMES, GROUP_ALGOS, get_algorithm

GroupEstimator = str  # one of GROUP_ESTIMATORS (the registry's group algorithms)
GROUP_ESTIMATORS: tuple[str, ...] = GROUP_ALGOS
ALGOS: tuple[str, ...] = ALGO_NAMES


class AdvantageReturns(NamedTuple):
    """advantages: (B, T) policy-gradient weights; returns: (B, T) value targets (see compute_advantages)."""

    advantages: Tensor
    returns: Tensor


def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def _zero_padding(x: Tensor, response_mask: Tensor) -> Tensor:
    return torch.where(response_mask != 0, x, torch.zeros_like(x))


@torch.no_grad()
def gae(token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float) -> AdvantageReturns:
    """Generalised advantage estimation (Schulman et al. 2016) over right-padded responses.

    Args:
        token_rewards: Shape (B, T), r_t.
        values: Shape (B, T), V(s_t) from the critic at the time of the rollout (old values).
        response_mask: Shape (B, T), 1 = response token. Positions with 0 inside a response (a multi-turn
            row's environment tokens, masked out by the trainer) are skipped: the recurrence passes over them
            unchanged (no discount, no value), so the last policy token of a turn bootstraps from the first
            policy token of the next; they get advantage and return 0. For one contiguous run (single-turn)
            this is the plain recurrence.
        gamma: discount in [0, 1]; lam: GAE lambda in [0, 1].

    Returns:
        AdvantageReturns(advantages (B, T), returns = advantages + values (B, T)), 0 at padding.
        The state after the last response token is terminal: its value is 0.

    Raises:
        ValueError for mismatched shapes or gamma/lam outside [0, 1].
    """
    check_rank("token_rewards", token_rewards, 2, "(B, T)")
    check_same_shape("token_rewards", token_rewards, values=values, response_mask=response_mask)
    _check_discount("gamma", gamma)
    _check_discount("lam", lam)
    present = response_mask != 0
    rewards = _zero_padding(token_rewards.float(), response_mask)
    old_values = _zero_padding(values.float(), response_mask)  # V = 0 after the end: terminal
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        # delta_t = r_t + gamma * V_{t+1} - V_t                       (V_{t+1} = 0 past the response)
        # A_t     = delta_t + gamma * lam * A_{t+1}                   (A_{t+1} = 0 past the response)
        # Skipped positions (mask 0) carry next_value and next_advantage through unchanged: past the end of the
        # response both are still 0 (terminal), between two policy turns they are the next turn's.
        delta = rewards[:, t] + gamma * next_value - old_values[:, t]
        advantage = torch.where(present[:, t], delta + gamma * lam * next_advantage, 0.0)
        advantages[:, t] = advantage
        next_value = torch.where(present[:, t], old_values[:, t], next_value)
        next_advantage = torch.where(present[:, t], advantage, next_advantage)
    return AdvantageReturns(advantages, _zero_padding(advantages + old_values, response_mask))


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go G_t = r_t + gamma * G_{t+1} (G = 0 past the response); REINFORCE++'s signal.

    Shapes: token_rewards (B, T), response_mask (B, T) with 1 = response token -> (B, T), 0 at padding.
    Positions with 0 inside a response (multi-turn environment tokens) are skipped as in `gae`: G passes over
    them undiscounted, and they get 0.
    """
    check_rank("token_rewards", token_rewards, 2, "(B, T)")
    check_same_shape("token_rewards", token_rewards, response_mask=response_mask)
    _check_discount("gamma", gamma)
    present = response_mask != 0
    rewards = _zero_padding(token_rewards.float(), response_mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(present[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(present[:, t], running, 0.0)
    return returns


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise x over the positions where mask == 1 (all rows together) to mean 0 and std 1.

    Args:
        x: Shape (B, T). mask: Shape (B, T), 1 = counts.
        shift_mean: True -> (x - mean) / std. False -> the mean is added back: the result keeps x's
            masked mean and has std 1 (TRL's convention; used when the sign of the mean matters).
        eps: added to the variance (population variance, divides by N) before the square root.

    Returns:
        Shape (B, T), 0 where mask == 0. Whitening happens over this tensor only: whiten the whole
        rollout batch before splitting it into micro-batches or ranks, or the statistics differ.

    Raises:
        ValueError when no position is counted (there is nothing to normalise by).
    """
    check_rank("x", x, 2, "(B, T)")
    check_same_shape("x", x, mask=mask)
    if not bool((mask != 0).any()):
        raise ValueError("masked_whiten: mask has no position set to 1; cannot whiten an empty batch")
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_padding(whitened, mask)


@torch.no_grad()
def group_advantages(scores: Tensor, group_size: int, estimator: GroupEstimator = "grpo", eps: float = 1e-6) -> Tensor:
    """One advantage per response from its group's scores. Shape: scores (B,) -> (B,).

    Rows are ordered group by group: rows [k*G, (k+1)*G) are the G samples of prompt k.
        grpo:                  (s_i - mean_g) / (std_g + eps), std with Bessel's correction (N - 1),
                               as in DeepSeekMath and OpenRLHF
        dr_grpo:               s_i - mean_g (Dr. GRPO drops the std: it biases towards easy prompts)
        rloo:                  s_i - mean of the other G - 1 scores = G / (G - 1) * (s_i - mean_g)
        reinforce_pp_baseline: s_i - mean_g (the caller whitens over the batch afterwards)
    A group whose scores are all equal gets exactly 0 under every estimator, whatever the score's value.
    Computed in float64, returned as float32.

    Raises:
        ValueError when B % group_size != 0, group_size < 2 (no baseline exists for one sample), or
        the estimator is unknown.
    """
    check_rank("scores", scores, 1, "(B,)")
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"estimator must be one of {GROUP_ESTIMATORS}, got {estimator!r}")
    if not (isinstance(group_size, int) and group_size >= 2):
        raise ValueError(f"group_size must be an int >= 2 for {estimator!r}, got {group_size!r}")
    if scores.shape[0] % group_size:
        raise ValueError(
            f"scores has {scores.shape[0]} rows, not a multiple of group_size={group_size}; "
            f"rows must come in whole groups of samples of the same prompt"
        )
    grouped = scores.double().view(-1, group_size)  # float64: float32's rounding of the mean is ~1e-7 of it
    mean = grouped.mean(dim=-1, keepdim=True)
    if estimator == "grpo":
        shaped = (grouped - mean) / (grouped.std(dim=-1, keepdim=True) + eps)
    elif estimator == "rloo":
        leave_one_out_mean = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
        shaped = grouped - leave_one_out_mean
    else:
        shaped = grouped - mean
    # A group of equal scores carries no signal: exactly 0, not the rounding error of its mean (8 x 0.7
    # gives deviations ~1e-8 in float32, which grpo's division by a std of the same size makes O(0.1)).
    flat = grouped.amax(dim=-1, keepdim=True) == grouped.amin(dim=-1, keepdim=True)
    return torch.where(flat, 0.0, shaped).float().reshape(-1)


def _place_at_last_token(per_row: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) -> (B, T) with per_row[b] at row b's last response token, 0 elsewhere and for empty rows."""
    last_index, has_response = last_response_index(response_mask)
    placed = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    return placed.scatter(-1, last_index[:, None], (per_row.float() * has_response)[:, None])


def kl_token_rewards(
    token_rewards: Tensor, scores: Tensor, response_mask: Tensor, reward_clip: Optional[float] = None
) -> Tensor:
    """The KL part of token rewards: token_rewards minus the clipped score at the last response token.

    Shapes: token_rewards (B, T), scores (B,), response_mask (B, T) -> (B, T). Exact only when
    token_rewards came from token_level_rewards(scores, ..., reward_clip) with the same scores and
    reward_clip; it is all 0 when the KL coefficient was 0 (KL in the loss instead).
    """
    return token_rewards.float() - _place_at_last_token(clip_scores(scores, reward_clip), response_mask)


@torch.no_grad()
def compute_advantages(
    algo: str,
    *,
    scores: Tensor,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Optional[Tensor] = None,
    group_size: int = 1,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    reward_clip: Optional[float] = None,
) -> AdvantageReturns:
    """Advantages and returns for one rollout batch, by algorithm.

    Args:
        algo: one of ALGOS (ppoflow.config.AlgoConfig.name); its registry entry
            (ppoflow/algorithms.py) says which estimator runs.
        scores: Shape (B,), scalar reward of each response.
        token_rewards: Shape (B, T), token_level_rewards(scores, kl, response_mask, kl_coef,
            reward_clip): the KL penalty is in it when the KL goes in the reward (kl_coef > 0), and it
            is pure score when the KL goes in the loss (build it with kl_coef = 0 then).
        response_mask: Shape (B, T), 1 = response token.
        values: Shape (B, T), old critic values; required for "ppo", ignored otherwise.
        group_size: G, samples per prompt (rows grouped as in group_advantages); group algos only.
        gamma, lam: discount and GAE lambda (lam is used by "ppo" only).
        whiten: masked whitening of the advantages over the batch, for "ppo", "reinforce_pp" and
            "reinforce_pp_baseline" (REINFORCE++ is defined with it; False is an ablation). Ignored by
            "grpo", "dr_grpo", "rloo": they are already normalised per group, and whitening would
            undo Dr. GRPO's point of not dividing by a std.
        reward_clip: the reward_clip given to token_level_rewards. Group algos use clip(scores) so
            the score they shape is the one in token_rewards.

    What each algo computes: see the module docstring.

    Returns:
        AdvantageReturns, each (B, T) float32, 0 at padding.

    Raises:
        ValueError for an unknown algo, "ppo" without values, or shape / group errors (see the
        functions called).
    """
    kind = get_algorithm(algo).advantage
    check_rank("token_rewards", token_rewards, 2, "(B, T)")
    check_same_shape("token_rewards", token_rewards, response_mask=response_mask)
    check_batch_of_rows("scores", scores, "token_rewards", token_rewards)
    if kind == "gae":
        if values is None:
            raise ValueError("algo 'ppo' needs values (B, T) from the critic; got None")
        advantages, returns = gae(token_rewards, values, response_mask, gamma, lam)
        if whiten:
            advantages = masked_whiten(advantages, response_mask)
        return AdvantageReturns(advantages, returns)
    if kind == "reinforce":
        returns = discounted_returns(token_rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask) if whiten else returns
        return AdvantageReturns(advantages, returns)
    kl_part = kl_token_rewards(token_rewards, scores, response_mask, reward_clip)
    shaped_scores = group_advantages(clip_scores(scores, reward_clip), group_size, algo)
    if kind == "reinforce_group_baseline":
        shaped_rewards = kl_part + _place_at_last_token(shaped_scores, response_mask)
        returns = discounted_returns(shaped_rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask) if whiten else returns
        return AdvantageReturns(advantages, returns)
    broadcast = _zero_padding(shaped_scores[:, None].expand_as(kl_part), response_mask)
    advantages = broadcast + discounted_returns(kl_part, response_mask, gamma)
    return AdvantageReturns(advantages, advantages.clone())
