"""Who a run is: `<root>/<run>/run.json`, written at the run's first start.

    {"run_id": "3f2a...", "created_unix": 1764120000.0, "results_epoch": 0,
     "inputs": {"model.policy_path": {"path": "...", "sha256": "..."}, ...}}

- `run_id` (a random hex id) is made once, when the run folder gets its first start, and moves with the folder
  (a run moved to another root or bucket keeps it). Every persisted stage result is keyed by it
  (tasks/cache_keys.py), so two runs of the same name under two roots, or a run deleted and started again,
  never answer each other's stages, wherever the results persist (the run's folder in-process, Prefect's shared
  result storage on warm workers).
- `results_epoch` counts how often the run's persisted stage results were disowned (`ppoflow runs repair`
  after quarantining a checkpoint): it is part of the same key, so after a repair every stage that is not
  committed runs again, on any worker.
- `inputs`: content hashes of the local files the run depends on (flows/run_inputs.py), recorded at the first
  start and compared at every later one.

A missing record reads as None (a run folder from before this file, or a stage called outside a run).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from storage.fs import join, read_json, write_json
from storage.layout import RunLayout

RUN_RECORD = "run.json"


def run_record_path(layout: RunLayout) -> str:
    return join(layout.run_dir, RUN_RECORD)


def read_run_record(layout: RunLayout) -> Optional[dict[str, Any]]:
    return read_json(layout.fs, run_record_path(layout))


def write_run_record(layout: RunLayout, record: dict[str, Any]) -> None:
    write_json(layout.fs, run_record_path(layout), record)


def new_run_record(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"run_id": uuid.uuid4().hex, "created_unix": time.time(), "results_epoch": 0, "inputs": inputs}


def results_identity(layout: RunLayout) -> str:
    """`<run_id>.<results_epoch>`, what stage cache keys hold of the run; "unrecorded" without a run.json."""
    record = read_run_record(layout)
    if record is None:
        return "unrecorded"
    return f"{record['run_id']}.{record.get('results_epoch', 0)}"


def disown_results(layout: RunLayout) -> int:
    """Move the run to a new results epoch: no stage result persisted before answers again. Returns the epoch;
    a run without a record gets one (with no inputs recorded: the next start records them)."""
    record = read_run_record(layout) or new_run_record({})
    record["results_epoch"] = int(record.get("results_epoch", 0)) + 1
    write_run_record(layout, record)
    return record["results_epoch"]
