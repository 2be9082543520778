"""One convention for every benchmark: end with one JSON line of figures, appended to bench/results/<name>.jsonl."""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def emit(name: str, figures: dict) -> dict:
    """Add bench, date (UTC ISO), commit and cpu_count to `figures`; append as one JSON line; print it."""
    line = {"bench": name, **figures,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "cpu_count": os.cpu_count()}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    text = json.dumps(line, sort_keys=False)
    with open(RESULTS_DIR / f"{name}.jsonl", "a") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return line
