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
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    """Cores, memory and CPU model of this machine (for BENCHMARKS.md)."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return {"cores": os.cpu_count(), "mem_gib": mem_gib, "cpu_model": model}


def emit(name: str, figures: dict, results_dir: Path | None = None) -> dict:
    """Add bench, date (UTC ISO), commit and machine to `figures`; append as one JSON line to
    <results_dir>/<name>.jsonl (default bench/results; a smoke run passes another folder); print it."""
    line = {
        "bench": name,
        **figures,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "cpu_count": os.cpu_count(),
        "machine": machine(),
    }
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(line, sort_keys=False)
    with open(folder / f"{name}.jsonl", "a") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return line
