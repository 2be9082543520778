"""Which pairs each optimizer step trains on, as a pure function of (seed, step); and the padded tensors.

Epoch e: the pairs in `epoch_permutation(P, seed, e)` order (engines/data.py); the last P mod batch_size of
that order are left out of the epoch (a different few each epoch), the rest are sorted by length (ties in
permutation order) and cut into batches of batch_size pairs, and the batches are shuffled (seeded by seed
and e). So pairs of similar length share a batch (little padding), while the order of batches stays random.
Global step s is batch s mod S of epoch s // S (S = P // batch_size steps per epoch): the data cursor is
the step number, nothing else needs saving to resume.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import NamedTuple

import torch

from engines.data import epoch_permutation
from engines.rm.data import PreferencePairs


def steps_per_epoch(num_pairs: int, batch_size: int) -> int:
    return num_pairs // batch_size


@lru_cache(maxsize=4)
def _epoch_plan(lengths: tuple[int, ...], batch_size: int, seed: int, epoch: int) -> tuple[tuple[int, ...], ...]:
    order = epoch_permutation(len(lengths), seed, epoch)
    usable = order[: len(order) - len(order) % batch_size]
    rank = {pair: k for k, pair in enumerate(usable)}
    by_length = sorted(usable, key=lambda pair: (lengths[pair], rank[pair]))
    batches = [tuple(by_length[k : k + batch_size]) for k in range(0, len(by_length), batch_size)]
    random.Random(f"ppoflow-rm-batches-{seed}-{epoch}").shuffle(batches)
    return tuple(batches)


def batch_for_step(lengths: list[int], batch_size: int, seed: int, step: int) -> list[int]:
    """Pair indices of global optimizer step `step` (0-based); see the module docstring.

    Raises ValueError when there are fewer pairs than one batch.
    """
    per_epoch = steps_per_epoch(len(lengths), batch_size)
    if per_epoch == 0:
        raise ValueError(f"{len(lengths)} pairs make no batch of {batch_size}")
    epoch, index = divmod(step, per_epoch)
    return list(_epoch_plan(tuple(lengths), batch_size, seed, epoch)[index])


class PairBatch(NamedTuple):
    """One forward's rows: input_ids / attention_mask (2b, T), padded, the b chosen rows first and then the
    b rejected rows in the same pair order; margins (b,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    margins: torch.Tensor

    @property
    def pairs(self) -> int:
        return self.margins.shape[0]


def collate(pairs: PreferencePairs, indices: list[int], pad_token_id: int, padding_side: str = "left") -> PairBatch:
    """Chosen and rejected sides of `indices` as one padded batch (one forward for both sides).

    Left padding (the default) puts every row's last token in the last column, which lets the forward skip
    the last layer's MLP on the other columns (engines/rm/loss.sequence_scores); scores are the same.
    """
    rows = [pairs.chosen_ids[i] for i in indices] + [pairs.rejected_ids[i] for i in indices]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, ids in enumerate(rows):
        cols = slice(0, len(ids)) if padding_side == "right" else slice(width - len(ids), width)
        input_ids[j, cols] = torch.tensor(ids, dtype=torch.long)
        attention_mask[j, cols] = 1
    margins = torch.tensor([pairs.margins[i] for i in indices], dtype=torch.float32)
    return PairBatch(input_ids, attention_mask, margins)
