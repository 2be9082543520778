"""Tables that fit the width they are printed at, on a terminal and on a pipe, without cutting a cell.

rich's Table squeezes every column into the console's width (80 on a pipe): `ppoflow shards stats ... | cat` gave
9 columns of 2-6 characters, cut with … or left blank (the `rows` column) although every cell had data.

`FitTable` lays its columns out at their natural width (the widest of the name and the cells) instead:
- all of them side by side when they fit the width;
- otherwise in as many tables as needed, one after the other, each with its header and the first `key` columns
  (the folder, the iteration) repeated, so every row stays on one line and every cell is whole;
- a single column that is wider than the width on its own (a long path) is printed whole: the line is longer than
  the width, never cut.
The width is the console's: the terminal's, or on a pipe $COLUMNS, else 80 (rich's rule).

`Lines` prints `label  value` lines whole (paths, commands), never wrapped inside a value.
"""

from __future__ import annotations

from typing import Optional, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

# rich's default box with padding (0, 1): a border and a space on either side of every column, plus one edge.
_PER_COLUMN = 3


def table_width(widths: Sequence[int]) -> int:
    """The printed width of a rich Table (default box, padding 1) whose columns have these cell widths."""
    return sum(widths) + _PER_COLUMN * len(widths) + 1


def column_groups(widths: Sequence[int], width: int, key: int = 1) -> list[list[int]]:
    """Indices of the columns of each table: the first `key` columns in every one, then as many of the others, in
    order, as fit `width` (a column too wide for any table still gets one of its own). One group when all fit."""
    keys = list(range(min(key, len(widths))))
    groups: list[list[int]] = []
    current = list(keys)
    for index in range(len(keys), len(widths)):
        fits = table_width([widths[i] for i in current + [index]]) <= width
        if not fits and len(current) > len(keys):
            groups.append(current)
            current = list(keys)
        current.append(index)
    if len(current) > len(keys) or not groups:
        groups.append(current)
    return groups


class FitTable:
    """A table of text cells (rich markup allowed) laid out for the width it is printed at; see the module doc.

    columns: (name, justify) pairs; rows: one list of cells per row, as many as columns.
    """

    def __init__(
        self,
        title: Optional[str],
        columns: Sequence[tuple[str, str]],
        rows: Sequence[Sequence[str]],
        caption: str = "",
        key: int = 1,
    ):
        self.title, self.columns, self.caption, self.key = title, list(columns), caption, key
        self.rows = [[Text.from_markup(cell) for cell in row] for row in rows]

    def widths(self) -> list[int]:
        """Each column's natural width: its name's, or its widest cell's."""
        return [max([len(name)] + [row[i].cell_len for row in self.rows]) for i, (name, _) in enumerate(self.columns)]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = self.widths()
        groups = column_groups(widths, options.max_width, self.key)
        if self.title:  # one line, never wrapped: a table's title would wrap at a narrow table's width
            split = f" (in {len(groups)} tables to fit {options.max_width} columns)" if len(groups) > 1 else ""
            yield Text(self.title + split, style="bold", no_wrap=True, overflow="ignore")
        for group in groups:
            table = Table()
            for i in group:
                name, justify = self.columns[i]
                table.add_column(name, justify=justify, no_wrap=True, min_width=widths[i], max_width=widths[i])
            for row in self.rows:
                table.add_row(*(row[i] for i in group))
            needed = max(options.max_width, table_width([widths[i] for i in group]))
            yield from console.render(table, options.update(width=needed, max_width=needed))
        if self.caption:
            yield Text(self.caption, style="dim", no_wrap=True, overflow="ignore")


class Lines:
    """`label  value` lines, the labels aligned, each value whole on its line (never wrapped)."""

    def __init__(self, pairs: Sequence[tuple[str, str]]):
        self.pairs = list(pairs)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        label_width = max((len(label) for label, _ in self.pairs), default=0)
        for label, value in self.pairs:
            yield Text(f"{label:<{label_width}}  {value}", no_wrap=True, overflow="ignore")
