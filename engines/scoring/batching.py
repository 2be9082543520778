"""Group scoring rows into micro-batches by a token budget, longest first, to limit padding.

A micro-batch is padded to its longest row, so its cost is `len(batch) * max(lengths in batch)` tokens
(its "padded size"). Sorting rows by length before grouping puts rows of similar length together: on
skewed lengths (a few long responses among many short ones) this pads far less than fixed-size batches
in arrival order, where one long row inflates every row of its batch to its length.
"""

from __future__ import annotations

from typing import Optional, Sequence


def token_budget_batches(
    lengths: Sequence[int], token_budget: int, max_batch_rows: Optional[int] = None
) -> list[list[int]]:
    """Partition row indices into micro-batches whose padded size fits `token_budget`.

    lengths:        (N,) token count of each row (prompt + response for scoring), >= 0.
    token_budget:   the largest padded size `len(batch) * max(lengths[batch])` allowed, >= 1.
    max_batch_rows: optional cap on rows per batch (e.g. a reward source's batch_size).

    Returns batches of indices into `lengths`. Indices are taken in descending length (ties in index
    order), and each batch is a run of that order, so the first index of a batch is its longest row.
    Every index appears exactly once.

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
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0  # the first row of a batch is its longest, since rows come in descending length
    for i in order:
        full = max_batch_rows is not None and len(current) >= max_batch_rows
        if current and (full or (len(current) + 1) * longest > token_budget):
            batches.append(current)
            current = []
        if not current:
            longest = lengths[i]
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Padding tokens the batches add: sum over batches of `len(b) * max(lengths[b]) - sum(lengths[b])`."""
    total = 0
    for batch in batches:
        if batch:
            sizes = [lengths[i] for i in batch]
            total += len(sizes) * max(sizes) - sum(sizes)
    return total
