"""The built-in tasks' datasets: rows written as one .jsonl file, the format data.path reads."""

from __future__ import annotations

import json
from pathlib import Path


def write_rows(out: str | Path, rows: list[dict]) -> Path:
    """Write `rows` to `out` (one JSON object a line), creating its folder; returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out
