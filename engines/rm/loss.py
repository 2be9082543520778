"""Bradley-Terry reward-model math: the pairwise loss and accuracy, and the last-token pooling.

Notation: P pairs; r_c, r_r (P,) the scalar scores of the chosen and rejected texts; m (P,) a margin.
    loss_i = -log sigmoid(r_c,i - r_r,i - m_i)        (Bradley-Terry; with a margin, Llama 2's RM loss)
    accuracy = mean_i [r_c,i > r_r,i]                  (a tie counts as wrong; the margin is not used)
`-log sigmoid(x)` is computed as `softplus(-x)`, which stays finite for large |x|.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from engines.trainer.forward import last_layer_mlp_on


class PairStats(NamedTuple):
    """loss: scalar mean over pairs (the training loss); per_pair_loss (P,); accuracy: scalar in [0, 1];
    margin_mean: scalar mean of r_c - r_r (how far apart the model puts the pairs)."""

    loss: torch.Tensor
    per_pair_loss: torch.Tensor
    accuracy: torch.Tensor
    margin_mean: torch.Tensor


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: Optional[torch.Tensor] = None) -> PairStats:
    """Loss and accuracy of scores `chosen` (P,) against `rejected` (P,); `margin` (P,) or None = 0.

    Raises ValueError when the shapes differ or P = 0 (a mean over no pairs is not a loss).
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen and rejected scores must both have shape (P,), got {tuple(chosen.shape)} "
            f"and {tuple(rejected.shape)}"
        )
    if chosen.numel() == 0:
        raise ValueError("no pairs to score: P = 0")
    diff = chosen.float() - rejected.float()
    if margin is not None:
        if margin.shape != chosen.shape:
            raise ValueError(f"margin must have shape {tuple(chosen.shape)}, got {tuple(margin.shape)}")
        diff = diff - margin.float()
    per_pair = F.softplus(-diff)  # = -log sigmoid(diff)
    raw = chosen.float() - rejected.float()
    return PairStats(per_pair.mean(), per_pair, (raw > 0).float().mean(), raw.mean())


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last real token (B,), for left, right or no padding. attention_mask (B, T): 1 = token.

    The rightmost 1 of each row: argmax over (column index x mask). Raises ValueError for a row with no token.
    """
    if (attention_mask.sum(dim=1) == 0).any():
        raise ValueError("a row of the attention mask has no token: nothing to score")
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (columns * attention_mask.long()).argmax(dim=1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions (B, T) counting real tokens only, so a left-padded row sees the positions an unpadded one does."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scores (B,) float32 of a `*ForSequenceClassification` model (or the DeepSpeed engine around one).

    Runs the backbone (B, T, H), takes the hidden state at each row's last real token (B, H) and applies
    the score head there only: the same value the model's own forward returns for that row (it applies the
    head at every column, then picks the last non-pad one), without the (B, T) head output.
    When every row ends in the last column (left padding, or none), the last decoder layer's MLP runs on
    that column only (engines/trainer/forward.last_layer_mlp_on: after the last layer nothing mixes columns,
    so the other columns' outputs would be thrown away): the same numbers, ~1/L of the MLP work less.
    Raises TypeError naming the class when it has no `score` head or base model.
    """
    module = getattr(model, "module", model)
    backbone = getattr(module, getattr(module, "base_model_prefix", ""), None)
    head = getattr(module, "score", None)
    if backbone is None or head is None:
        raise TypeError(
            f"{type(module).__name__} is not a decoder *ForSequenceClassification model "
            f"(needs a `score` head and its base model)"
        )
    ends_at_last_column = bool(attention_mask[:, -1].all())
    trim = last_layer_mlp_on(module, 1) if ends_at_last_column else contextlib.nullcontext()
    with trim:
        hidden = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    pooled = hidden[rows, last_token_index(attention_mask)]  # (B, H)
    return head(pooled).squeeze(-1).float()
