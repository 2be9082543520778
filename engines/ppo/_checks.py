"""Input checks shared by the PPO math: a wrong shape is an error that names the argument and both shapes.

Broadcasting would otherwise turn a (B,) tensor against a (B, T) tensor into a silent (B, B) or (B, T)
result, which is the commonest bug in RL math code.
"""

from __future__ import annotations

from torch import Tensor


def check_rank(name: str, tensor: Tensor, rank: int, layout: str) -> None:
    """Raise ValueError unless `tensor` has `rank` dimensions; `layout` says which, e.g. "(B, T)"."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(tensor).__name__}")
    if tensor.dim() != rank:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(tensor.shape)}")


def check_same_shape(reference_name: str, reference: Tensor, **others: Tensor) -> None:
    """Raise ValueError when any of `others` does not have exactly `reference`'s shape."""
    for name, tensor in others.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has "
                f"{tuple(reference.shape)}; they must match"
            )


def check_batch_of_rows(name: str, vector: Tensor, rows_name: str, rows: Tensor) -> None:
    """Raise ValueError unless `vector` is (B,) with B = rows.shape[0] (one value per sequence)."""
    check_rank(name, vector, 1, "(B,)")
    if vector.shape[0] != rows.shape[0]:
        raise ValueError(f"{name} has {vector.shape[0]} rows but {rows_name} has {rows.shape[0]}; they must match")
