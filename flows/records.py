"""Small JSON records a run keeps beside its shards: per-stage manifests and metrics.jsonl.

Stage records (`<run>/iter-000003/_stages/<stage>.json`) let a parent flow read what a stage deployment on
another pool produced, and let `ppoflow runs show` list an iteration's outputs. metrics.jsonl has one line
per iteration; rewriting an iteration's line (after a retry) replaces it, never duplicates it. Both are
rewritten whole in one PUT: S3 has no append.
"""
from __future__ import annotations

import json
from typing import Any

from storage.fs import join, read_json, write_bytes_atomic, write_json
from storage.layout import RunLayout


def stage_record_path(layout: RunLayout, iteration: int, stage: str) -> str:
    return join(layout.iteration_dir(iteration), "_stages", f"{stage}.json")


def write_stage_record(layout: RunLayout, iteration: int, stage: str, manifest: dict[str, Any]) -> None:
    write_json(layout.fs, stage_record_path(layout, iteration, stage), manifest)


def read_stage_record(layout: RunLayout, iteration: int, stage: str) -> dict[str, Any] | None:
    return read_json(layout.fs, stage_record_path(layout, iteration, stage))


def read_metrics(layout: RunLayout) -> list[dict[str, Any]]:
    if not layout.fs.exists(layout.metrics_path):
        return []
    with layout.fs.open(layout.metrics_path, "rb") as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]


def record_metrics(layout: RunLayout, row: dict[str, Any]) -> None:
    """Put `row` (which has an "iteration") into metrics.jsonl, replacing that iteration's earlier line."""
    rows = [r for r in read_metrics(layout) if r.get("iteration") != row["iteration"]] + [row]
    rows.sort(key=lambda r: r["iteration"])
    write_bytes_atomic(layout.fs, layout.metrics_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
