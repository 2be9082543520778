"""ExperienceBatch: one rollout batch as padded tensors, built from the ragged lists of the shards.

Layout (the forward helper relies on it): prompts LEFT-padded to P columns, responses RIGHT-padded to R
columns, so every response starts at column P of the concatenated (B, P + R) sequence.

    prompt_ids      (B, P) long   pad where prompt_mask == 0
    prompt_mask     (B, P) long   1 = prompt token, 0 = left padding
    response_ids    (B, R) long   pad where response_mask == 0
    response_mask   (B, R) float  1 = response token, 0 = right padding
    scores          (B,)   float  scalar reward per response (weighted sum of sources, clipped)
    ref_logprobs    (B, R) float  reference log-probs of the response tokens (0 at padding)
    rollout_logprobs(B, R) float  the sampler's log-probs (0 at padding), or None when the sampler gave
                                  none; the mismatch metric and truncated importance sampling (algo.tis_cap)
    group_ids       (B,)   long   rows with the same id are samples of the same prompt; rows come group by
                                  group (contiguous), as the group estimators need
    truncated       (B,)   bool   True = the response hit max_new_tokens (finish_reason "length"), or None
                                  when the finish reasons were not given; read by train.mask_truncated
    policy_mask     (B, R) float  multi-turn rows (the shards' token_owner): 1 = a token the policy sampled,
                                  0 = an environment token (context: attended to, never trained on) or
                                  padding; None for single-turn batches, where every response token is the
                                  policy's. `trained_mask` is the one to mask losses, KL and advantages with;
                                  response_mask stays the attention mask of the response.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import numpy as np
import torch


def _lengths_and_values(rows: Sequence[Sequence[float]], width: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(B,) row lengths and every row's values concatenated; ValueError naming the row when one exceeds width."""
    lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    if lengths.size and lengths.max() > width:
        b = int(lengths.argmax())
        raise ValueError(f"row {b} has {int(lengths[b])} values for {width} columns")
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lengths.sum()))
    return lengths, values


def right_pad(rows: Sequence[Sequence[float]], width: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    """(B, width) tensor of `rows` right-padded with `value`.

    Filled in one vectorised step: a row mask, read in row-major order, takes the concatenated values in order
    (a small tensor per row cost ~0.5 s for 2,048 rows on 2 cores, once per padded field of every batch)."""
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    lengths, values = _lengths_and_values(rows, width, np_dtype)
    out = np.full((len(rows), width), value, dtype=np_dtype)
    out[np.arange(width) < lengths[:, None]] = values
    return torch.from_numpy(out)


def left_pad(rows: Sequence[Sequence[int]], width: int, value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) long tensor of `rows` left-padded with `value`, and its mask (1 = real token)."""
    lengths, values = _lengths_and_values(rows, width, np.int64)
    real = np.arange(width) >= (width - lengths)[:, None]
    ids = np.full((len(rows), width), value, dtype=np.int64)
    ids[real] = values
    return torch.from_numpy(ids), torch.from_numpy(real.astype(np.int64))


@dataclass
class ExperienceBatch:
    """See the module docstring for every field's shape and mask polarity."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    scores: torch.Tensor
    ref_logprobs: torch.Tensor
    rollout_logprobs: Optional[torch.Tensor]
    group_ids: torch.Tensor
    truncated: Optional[torch.Tensor] = None
    policy_mask: Optional[torch.Tensor] = None

    @classmethod
    def from_lists(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        scores: Sequence[float],
        ref_logprobs: Sequence[Sequence[float]],
        rollout_logprobs: Optional[Sequence[Sequence[float]]] = None,
        group_ids: Optional[Sequence[int]] = None,
        pad_token_id: int = 0,
        finish_reasons: Optional[Sequence[str]] = None,
        token_owner: Optional[Sequence[Sequence[int]]] = None,
    ) -> "ExperienceBatch":
        """Pad ragged lists (the scored shards' columns of the same names; finish_reasons = `finish_reason`).

        token_owner None -> single-turn (policy_mask None); else (B,) lists of 1 = policy, 0 = environment
        token, each of its response's length.
        rollout_logprobs None -> the batch has none (no mismatch metric; algo.tis_cap refuses it).
        finish_reasons None -> `truncated` is None (train.mask_truncated refuses it).
        Raises ValueError naming the row when lengths disagree, groups are not contiguous, or a finish
        reason is not "stop" or "length".
        """
        n = len(prompt_ids)
        for name, seq in (("response_ids", response_ids), ("scores", scores), ("ref_logprobs", ref_logprobs)):
            if len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} rows, prompt_ids has {n}")
        if n == 0:
            raise ValueError("an experience batch needs at least one sample")
        group_ids = list(group_ids) if group_ids is not None else list(range(n))
        for b in range(n):
            if len(prompt_ids[b]) == 0:
                raise ValueError(f"row {b}: empty prompt")
            per_token = [("ref_logprobs", ref_logprobs[b])]
            if rollout_logprobs is not None:
                per_token.append(("rollout_logprobs", rollout_logprobs[b]))
            if token_owner is not None:
                per_token.append(("token_owner", token_owner[b]))
            for name, seq in per_token:
                if len(seq) != len(response_ids[b]):
                    raise ValueError(
                        f"row {b}: {name} has {len(seq)} values for {len(response_ids[b])} response tokens"
                    )
        _check_contiguous_groups(group_ids)
        truncated = None if finish_reasons is None else _truncated(finish_reasons, n)
        width_p = max(len(p) for p in prompt_ids)
        width_r = max(1, max(len(r) for r in response_ids))  # >= 1 column even if every response is empty
        prompt, prompt_mask = left_pad(prompt_ids, width_p, pad_token_id)
        return cls(
            prompt_ids=prompt,
            prompt_mask=prompt_mask,
            response_ids=right_pad(response_ids, width_r, pad_token_id, torch.long),
            response_mask=right_pad([[1.0] * len(r) for r in response_ids], width_r, 0.0, torch.float32),
            scores=torch.tensor(list(scores), dtype=torch.float32),
            ref_logprobs=right_pad(ref_logprobs, width_r, 0.0, torch.float32),
            rollout_logprobs=(
                right_pad(rollout_logprobs, width_r, 0.0, torch.float32) if rollout_logprobs is not None else None
            ),
            group_ids=torch.tensor(group_ids, dtype=torch.long),
            truncated=truncated,
            policy_mask=_policy_mask(token_owner, n, width_r),
        )

    def __len__(self) -> int:
        return self.scores.shape[0]

    @property
    def group_size(self) -> int:
        """Samples per group; ValueError when groups have different sizes."""
        _, counts = torch.unique_consecutive(self.group_ids, return_counts=True)
        if not bool((counts == counts[0]).all()):
            raise ValueError(
                f"groups have different sizes {sorted(set(counts.tolist()))}; group estimators need equal groups"
            )
        return int(counts[0])

    def select(self, rows: torch.Tensor) -> "ExperienceBatch":
        """The sub-batch of `rows` (B',) indices, every field sliced the same way."""
        return ExperienceBatch(**{f.name: _maybe(getattr(self, f.name), lambda t: t[rows]) for f in fields(self)})

    def to(self, device: torch.device | str) -> "ExperienceBatch":
        return ExperienceBatch(**{f.name: _maybe(getattr(self, f.name), lambda t: t.to(device)) for f in fields(self)})

    @property
    def trained_mask(self) -> torch.Tensor:
        """(B, R) float, 1 = a token the policy sampled: policy_mask for multi-turn rows, else response_mask."""
        return self.response_mask if self.policy_mask is None else self.policy_mask

    def loss_mask(self, mask_truncated: bool) -> torch.Tensor:
        """(B, R) float, 1 = the token counts in the loss: trained_mask (the policy's own tokens), with truncated
        rows zeroed when mask_truncated (DAPO's overlong filtering). ValueError when asked to mask without
        finish reasons."""
        if not mask_truncated:
            return self.trained_mask
        if self.truncated is None:
            raise ValueError(
                "train.mask_truncated needs each sample's finish_reason; this batch was built "
                "without finish_reasons (ExperienceBatch.from_lists(..., finish_reasons=...))"
            )
        return self.trained_mask * (~self.truncated).to(self.response_mask.dtype)[:, None]


def _maybe(value: Optional[torch.Tensor], fn) -> Optional[torch.Tensor]:
    return None if value is None else fn(value)


def _policy_mask(token_owner: Optional[Sequence[Sequence[int]]], n: int, width: int) -> Optional[torch.Tensor]:
    """(B, width) float of the owners (1 = policy), right-padded with 0; None without owners. ValueError naming
    the row for an owner other than 0 or 1."""
    if token_owner is None:
        return None
    if len(token_owner) != n:
        raise ValueError(f"token_owner has {len(token_owner)} rows, prompt_ids has {n}")
    for b, owners in enumerate(token_owner):
        if any(o not in (0, 1) for o in owners):
            raise ValueError(
                f"row {b}: token_owner holds {sorted(set(owners) - {0, 1})}; only 1 = policy, 0 = environment"
            )
    return right_pad(token_owner, width, 0.0, torch.float32)


def _truncated(finish_reasons: Sequence[str], n: int) -> torch.Tensor:
    if len(finish_reasons) != n:
        raise ValueError(f"finish_reasons has {len(finish_reasons)} rows, prompt_ids has {n}")
    for b, reason in enumerate(finish_reasons):
        if reason not in ("stop", "length"):
            raise ValueError(f"row {b}: finish_reason {reason!r} is not 'stop' or 'length'")
    return torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)


def _check_contiguous_groups(group_ids: Sequence[int]) -> None:
    seen: set[int] = set()
    for b, g in enumerate(group_ids):
        if g in seen and (b == 0 or group_ids[b - 1] != g):
            raise ValueError(f"row {b}: group {g} is not contiguous; rows must come group by group")
        seen.add(g)
