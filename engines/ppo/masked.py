"""Masked reductions over (B, T) tensors. mask: 1 = the position counts (a response token), 0 = ignored.

Masked-out positions are selected away with where(), never multiplied by 0, so NaN/inf garbage at
padding (a critic's value at a pad token, a -inf log-prob) cannot leak into a result.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from engines.ppo._checks import check_same_shape


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of x where mask == 1. Shapes: x, mask (B, T) -> scalar, or (B,) with dim=-1."""
    check_same_shape("x", x, mask=mask)
    kept = torch.where(mask != 0, x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of x where mask == 1. Shapes: (B, T) -> scalar, or (B,) with dim=-1.

    Rows / batches with no counted position give 0 (not NaN): an empty response has no tokens to
    average and contributes nothing.
    """
    count = (mask != 0).sum() if dim is None else (mask != 0).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance (divides by N, not N - 1) of x where mask == 1; scalar. (B, T) -> ()."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean).square(), mask)
