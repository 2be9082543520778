"""Group scoring rows into micro-batches by a token budget, longest first, to limit padding.

A micro-batch is padded to its longest row, so its cost is `len(batch) * max(lengths in batch)` tokens
(its "padded size"). Sorting rows by length before grouping puts rows of similar length together: on
skewed lengths (a few long responses among many short ones) this pads far less than fixed-size batches
in arrival order, where one long row inflates every row of its batch to its length.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence


def token_budget_batches(
    lengths: Sequence[int],
    token_budget: int,
    max_batch_rows: Optional[int] = None,
    keys: Optional[Sequence[Hashable]] = None,
) -> list[list[int]]:
    """Partition row indices into micro-batches whose padded size fits `token_budget`.

    lengths:        (N,) token count of each row (prompt + response for scoring), >= 0.
    token_budget:   the largest padded size `len(batch) * max(lengths[batch])` allowed, >= 1.
    max_batch_rows: optional cap on rows per batch (e.g. a reward source's batch_size).
    keys:           optional (N,) key of each row; rows with equal keys are taken one after another (a GRPO
                    group's samples, keyed by their prompt), so they share micro-batches: a forward that runs a
                    shared prompt once (engines/trainer/shared_prompt.py) then runs it once per micro-batch,
                    not once per row that sorting by length put elsewhere.

    Returns batches of indices into `lengths`. Indices are taken in descending length (ties in index
    order), and each batch is a run of that order, so the first index of a batch is its longest row.
    With `keys`, the order is by group: groups in descending order of their longest row (ties: the group
    whose first row comes first), each group's rows in descending length (ties in index order). Every
    index appears exactly once.

    A row longer than `token_budget` cannot fit any batch; it gets a batch of its own rather than an
    error, because dropping it would lose a sample and the model may still score it (the budget bounds
    memory per micro-batch, it is not a model limit). Rows of length 0 cost nothing and fill a batch
    up to `max_batch_rows`.

    Raises ValueError naming the row for a negative length, or naming the argument for a budget < 1
    or max_batch_rows < 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if max_batch_rows is not None and max_batch_rows < 1:
        raise ValueError(f"max_batch_rows must be >= 1 or None, got {max_batch_rows}")
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"row {i} has a negative length {n}")
    if keys is not None and len(keys) != len(lengths):
        raise ValueError(f"keys has {len(keys)} entries for {len(lengths)} rows: give one key per row")
    order = _row_order(lengths, keys)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0  # the longest row of `current` (with keys, a batch that starts mid-group may meet a longer row)
    for i in order:
        full = max_batch_rows is not None and len(current) >= max_batch_rows
        if current and (full or (len(current) + 1) * max(longest, lengths[i]) > token_budget):
            batches.append(current)
            current = []
        longest = max(longest, lengths[i]) if current else lengths[i]
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _row_order(lengths: Sequence[int], keys: Optional[Sequence[Hashable]]) -> list[int]:
    """Indices in descending length (ties in index order); with keys, group by group (token_budget_batches)."""
    by_length = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if keys is None:
        return by_length
    groups: dict[Hashable, list[int]] = {}
    for i in by_length:  # each group's rows in descending length; the first is its longest
        groups.setdefault(keys[i], []).append(i)
    ranked = sorted(groups.values(), key=lambda rows: (-lengths[rows[0]], min(rows)))
    return [i for rows in ranked for i in rows]


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Padding tokens the batches add: sum over batches of `len(b) * max(lengths[b]) - sum(lengths[b])`."""
    total = 0
    for batch in batches:
        if batch:
            sizes = [lengths[i] for i in batch]
            total += len(sizes) * max(sizes) - sum(sizes)
    return total
