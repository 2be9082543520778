"""Reading a run's metrics.jsonl (`<root>/<run>/metrics.jsonl`, one JSON row per iteration).

Below the flows that write it (flows/records.py) because stage processes read it too: a stage's deadline is
derived from the durations of its recent iterations (tasks/deadlines.py).
"""

from __future__ import annotations

import json
from typing import Any

from storage.layout import RunLayout


def complete_lines(data: bytes) -> list[bytes]:
    """The newline-terminated, non-blank lines of `data`; a last line without a newline is a torn append."""
    return [line for line in data.split(b"\n")[:-1] if line.strip()]


def read_metrics(layout: RunLayout) -> list[dict[str, Any]]:
    """The run's metrics rows in file order ([] before the first); a torn last line is left out."""
    if not layout.fs.exists(layout.metrics_path):
        return []
    with layout.fs.open(layout.metrics_path, "rb") as f:
        return [json.loads(line) for line in complete_lines(f.read())]
