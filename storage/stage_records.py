"""Stage records: `<run>/iter-NNNNNN/_stages/<stage>.json`, the manifest a stage of an iteration produced.

They let a parent flow read what a stage deployment on another pool produced, let a fork's replayed iteration find
its parent's manifests (storage/lineage.py), and let `ppoflow runs show` list an iteration's outputs. A record is
rewritten whole in one PUT (a retried stage replaces it, never duplicates it); a missing record reads as None.
"""

from __future__ import annotations

from typing import Any

from storage.fs import join, read_json, write_json
from storage.layout import RunLayout


def stage_record_path(layout: RunLayout, iteration: int, stage: str) -> str:
    return join(layout.iteration_dir(iteration), "_stages", f"{stage}.json")


def write_stage_record(layout: RunLayout, iteration: int, stage: str, manifest: dict[str, Any]) -> None:
    write_json(layout.fs, stage_record_path(layout, iteration, stage), manifest)


def read_stage_record(layout: RunLayout, iteration: int, stage: str) -> dict[str, Any] | None:
    return read_json(layout.fs, stage_record_path(layout, iteration, stage))
