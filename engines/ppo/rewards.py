"""Token-level rewards: the KL penalty on every response token, the scalar score on the last one.

Notation: B = sequences, T = positions of the response window. response_mask is 1 on response tokens
and 0 on padding (and on prompt positions, if the caller's window includes them). The response is one
contiguous run of 1s per row; a row of all 0s is an empty response.

    r_t = -beta * kl_t * m_t  +  1[t == last_b] * clip(score_b, -c, c)

where last_b is the last index with m == 1 in row b (OpenRLHF's `compute_reward`, InstructGPT's
shaping): the environment reward arrives when the response ends, the KL penalty keeps every token near
the reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from engines.ppo._checks import check_batch_of_rows, check_rank, check_same_shape


def clip_scores(scores: Tensor, reward_clip: Optional[float]) -> Tensor:
    """clip(scores, -reward_clip, reward_clip); None = unchanged. Shape (B,) -> (B,).

    Raises ValueError for reward_clip <= 0.
    """
    if reward_clip is None:
        return scores
    if not reward_clip > 0:
        raise ValueError(f"reward_clip must be > 0 or None, got {reward_clip!r}")
    return scores.clamp(-reward_clip, reward_clip)


def last_response_index(response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Index of each row's last response token and whether the row has one.

    Args:
        response_mask: Shape (B, T), 1 = response token.
    Returns:
        (last_index (B,) long, has_response (B,) bool). last_index is T - 1 for empty rows; ignore it there.
    """
    check_rank("response_mask", response_mask, 2, "(B, T)")
    present = response_mask != 0
    length = response_mask.shape[-1]
    # argmax returns the FIRST maximum, so search the flipped mask for the last 1.
    last_index = (length - 1) - present.flip(-1).to(torch.int8).argmax(dim=-1)
    return last_index, present.any(dim=-1)


def token_level_rewards(
    scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float, reward_clip: Optional[float] = None
) -> Tensor:
    """Per-token rewards for PPO / REINFORCE++: -kl_coef * kl everywhere, clipped score at the end.

    Args:
        scores: Shape (B,), the scalar reward of each response (weighted sum of reward sources).
        kl: Shape (B, T), a per-token KL estimate (kl_penalty); its values at padding are ignored.
        response_mask: Shape (B, T), 1 = response token, 0 = padding.
        kl_coef: beta >= 0, the KL coefficient (a KL controller's current value).
        reward_clip: c > 0 clips the score to [-c, c] before it is placed; None = no clip.

    Returns:
        Shape (B, T), float dtype of kl; 0 at padding; rows with an empty response are all 0 (their
        score has no token to land on). No gradient is meant to flow: pass detached inputs.

    Raises:
        ValueError for mismatched shapes, kl_coef < 0, reward_clip <= 0.
    """
    check_rank("kl", kl, 2, "(B, T)")
    check_same_shape("kl", kl, response_mask=response_mask)
    check_batch_of_rows("scores", scores, "kl", kl)
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
    # where(), not a multiply: a non-finite kl at a padding position must not leak in as NaN.
    rewards = torch.where(response_mask != 0, -kl_coef * kl, torch.zeros_like(kl))
    last_index, has_response = last_response_index(response_mask)
    placed = clip_scores(scores.to(kl.dtype), reward_clip) * has_response.to(kl.dtype)
    return rewards.scatter_add(-1, last_index[:, None], placed[:, None])


def overlong_penalty(response_lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty`. Shape (B,) -> (B,).

    With L_max = max_new_tokens, L_cache = buffer and |y| the response length in tokens (EOS included, as
    the sampler returned it):
        0                                          if |y| <= L_max - L_cache
        -penalty * (|y| - (L_max - L_cache)) / L_cache   if L_max - L_cache < |y| <= L_max
        -penalty                                   if |y| > L_max
    Added to the scalar reward: a response that runs into the cap loses up to `penalty`.

    Raises ValueError for buffer < 1, buffer > max_new_tokens or penalty <= 0.
    """
    check_rank("response_lengths", response_lengths, 1, "(B,)")
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"reward.overlong.buffer must be in [1, max_new_tokens={max_new_tokens}], got {buffer!r}")
    if not penalty > 0:
        raise ValueError(f"reward.overlong.penalty must be > 0, got {penalty!r}")
    exceed = (response_lengths.float() - (max_new_tokens - buffer)).clamp(min=0.0)
    return -(exceed / buffer * penalty).clamp(max=penalty)
