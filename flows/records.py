"""A run's metrics.jsonl, written by the flows, and handed to the run's trackers (flows/tracker.py).

metrics.jsonl has one line per iteration; rewriting an iteration's line (after a retry) replaces it, never
duplicates it. It gets the next iteration's line appended on a local disk and is rewritten whole otherwise (S3 has
no append). Reading it is storage/metrics.py's; the stage records beside the shards are storage/stage_records.py's.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from flows.tracker import track_row
from storage.fs import append_line_durably, is_local, write_bytes_atomic
from storage.layout import RunLayout
from storage.metrics import complete_lines, read_metrics  # noqa: F401 - read_metrics: the flows' import

_TAIL_BYTES = 1 << 16  # read from the end of metrics.jsonl to find its last line (a row is ~1 KB)
_ITERATION_PREFIX = re.compile(rb'^\{"iteration": (\d+)[,}]')


def _iteration_of(line: bytes) -> int:
    # Rows are written with "iteration" first, so its value is read without parsing the whole row.
    match = _ITERATION_PREFIX.match(line)
    return int(match.group(1)) if match else int(json.loads(line)["iteration"])


def _last_line_if_appendable(path: str) -> bytes | None:
    """The last line of a local metrics file that ends in a newline (read from its tail), else None."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read()
    except FileNotFoundError:
        return None
    if not tail.endswith(b"\n"):
        return None  # empty, or a torn append: rewrite
    lines = tail[:-1].rsplit(b"\n", 1)
    if len(lines) == 1 and size > len(tail):
        return None  # a last line longer than the tail read: rewrite
    return lines[-1]


def record_metrics(layout: RunLayout, row: dict[str, Any]) -> None:
    """Put `row` (which has an "iteration") into metrics.jsonl, replacing that iteration's earlier line,
    then hand it to the run's trackers (TensorBoard, and wandb / MLflow when set up: flows/tracker.py).

    A row after the file's last one is appended on a local disk (one fsynced write: the common case, so an
    iteration's cost does not grow with the run's length). Otherwise (a retried iteration, object storage,
    a torn append) the file is rewritten whole and atomically, rows sorted by iteration; other rows are
    moved as bytes, not parsed again (parsing and dumping every row took 65 ms per iteration at 2,000 rows).
    """
    line = (json.dumps(row) + "\n").encode()
    iteration = int(row["iteration"])
    path = layout.metrics_path
    if is_local(layout.fs):
        last = _last_line_if_appendable(path)
        if last is not None and last.strip() and _iteration_of(last) < iteration:
            append_line_durably(path, line)
            track_row(layout, row)
            return
    data = b""
    if layout.fs.exists(path):
        with layout.fs.open(path, "rb") as f:
            data = f.read()
    kept = [(_iteration_of(old), old) for old in complete_lines(data)]
    rows = sorted(
        [item for item in kept if item[0] != iteration] + [(iteration, line.rstrip(b"\n"))], key=lambda item: item[0]
    )
    write_bytes_atomic(layout.fs, path, b"".join(old + b"\n" for _, old in rows))
    track_row(layout, row)
