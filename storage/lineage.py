"""Forked runs: a run whose iterations 1..N are another run's, shared by reference, never copied.

    <fork>/run.json                                  {..., "parent": {run, root, iteration, run_id}}
    <fork>/checkpoints/iter-000005/_REFERENCE.json   {run, root, iteration}: "my checkpoint 5 is that run's"
    <parent>/_forks/<fork>.json                      {run, root, forked_at, iterations}: the parent's
                                                     checkpoints that fork refers to (its retention keeps them)
    <fork>/run.json's parent.replay = [N+1, N+M]     the fork's iterations N+1..N+M replay the parent's committed
                                                     rollout shards (runtime/replay.py): its rollout of those
                                                     iterations is the parent's, read in place (rollout_owner)

A reference folder reads as committed (storage/checkpoints.py resolves its marker and files through the
parent), so the fork's LATEST is N at its first start and its iteration N+1 loads the parent's checkpoint N;
iterations after N are the fork's own. A reference always names the run that holds the files (a fork of a
fork points past its parent when the checkpoint is older than that parent's fork point).

Order of writes, so that no crash leaves a fork referring to a checkpoint its owner may delete: the pin in the
owner's `_forks/` first, then the owner's marker is checked again, then the reference. Removing a reference
(the fork's own retention) goes the other way: the reference first, then the pin. A pin whose fork was deleted
stays (retention keeps that checkpoint) until `<parent>/_forks/<fork>.json` is deleted too.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from storage import fs as fsutil
from storage.layout import RunLayout
from storage.run_identity import read_run_record
from storage.stage_records import read_stage_record

REFERENCE_NAME = "_REFERENCE.json"
FORKS_DIR = "_forks"


def reference_path(layout: RunLayout, iteration: int) -> str:
    return fsutil.join(layout.checkpoint_dir(iteration), REFERENCE_NAME)


def read_reference(layout: RunLayout, iteration: int) -> Optional[dict[str, Any]]:
    """The reference that stands for `layout`'s checkpoint `iteration`, or None (none, or unreadable)."""
    try:
        reference = fsutil.read_json(layout.fs, reference_path(layout, iteration))
    except ValueError:
        return None
    if not isinstance(reference, dict) or reference.get("iteration") != iteration:
        return None
    return reference


def referenced_layout(layout: RunLayout, reference: dict[str, Any]) -> RunLayout:
    """The layout of the run a reference names (same storage settings as the referring run)."""
    return RunLayout(reference["root"], reference["run"], layout.storage_cfg)


def root_url(layout: RunLayout) -> str:
    """The run's root as a URL another run can resolve (an absolute path locally, s3://... on S3)."""
    return layout.url(layout.root)


def write_reference(child: RunLayout, owner: RunLayout, iteration: int) -> None:
    """Make `child`'s checkpoint `iteration` stand for `owner`'s (pin it there first: see the module docstring)."""
    fsutil.write_json(
        child.fs,
        reference_path(child, iteration),
        {"run": owner.run_name, "root": root_url(owner), "iteration": iteration},
    )


def fork_record_path(owner: RunLayout, child_name: str) -> str:
    return fsutil.join(owner.run_dir, FORKS_DIR, f"{child_name}.json")


def pin(owner: RunLayout, child: RunLayout, forked_at: int, iterations: list[int]) -> None:
    """Record in `owner` that `child` refers to its checkpoints `iterations` (added to any already pinned)."""
    path = fork_record_path(owner, child.run_name)
    record = fsutil.read_json(owner.fs, path) or {
        "run": child.run_name,
        "root": root_url(child),
        "forked_at": forked_at,
        "created_unix": time.time(),
        "iterations": [],
    }
    record["iterations"] = sorted(set(record["iterations"]) | set(iterations))
    fsutil.write_json(owner.fs, path, record)


def unpin(owner: RunLayout, child_name: str, iteration: int) -> None:
    """`child_name` no longer refers to `owner`'s checkpoint `iteration`. The record stays (it is the lineage
    `ppoflow runs show` lists), with that iteration off its list."""
    path = fork_record_path(owner, child_name)
    record = fsutil.read_json(owner.fs, path)
    if record is None or iteration not in record.get("iterations", []):
        return
    record["iterations"] = [i for i in record["iterations"] if i != iteration]
    fsutil.write_json(owner.fs, path, record)


def fork_records(layout: RunLayout) -> list[dict[str, Any]]:
    """The `_forks/*.json` records of `layout`'s run: the runs forked from it (sorted by name)."""
    folder = fsutil.join(layout.run_dir, FORKS_DIR)
    layout.fs.invalidate_cache(folder)
    try:
        names = sorted(layout.fs.ls(folder, detail=False))
    except FileNotFoundError:
        return []
    records = []
    for name in names:
        if name.endswith(".json"):
            try:
                record = fsutil.read_json(layout.fs, name)
            except ValueError:
                record = None
            # An unreadable record pins nothing we could name: retention then keeps everything (see pinned_iterations).
            records.append(record if isinstance(record, dict) else {"run": name, "iterations": None})
    return records


def pinned_iterations(layout: RunLayout) -> Optional[set[int]]:
    """The checkpoints of `layout`'s run that forks refer to; None when a fork record is unreadable (then retention
    must remove nothing: it cannot tell which checkpoints that fork needs)."""
    pinned: set[int] = set()
    for record in fork_records(layout):
        if not isinstance(record.get("iterations"), list):
            return None
        pinned |= set(record["iterations"])
    return pinned


def parent_of(run_record: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The `parent` entry of a run.json ({run, root, iteration, run_id}), or None for a run that is no fork."""
    parent = (run_record or {}).get("parent")
    return parent if isinstance(parent, dict) else None


def replayed_iterations(run_record: Optional[dict[str, Any]]) -> range:
    """The iterations whose rollout a fork replays from its parent (parent.replay = [first, last]); empty otherwise."""
    replay = (parent_of(run_record) or {}).get("replay")
    return range(int(replay[0]), int(replay[1]) + 1) if isinstance(replay, list) and len(replay) == 2 else range(0)


def rollout_owner(layout: RunLayout, iteration: int) -> RunLayout:
    """The run whose folder holds `layout`'s rollout shards of `iteration`: `layout` itself, or, when it is a fork
    that replays that iteration, its parent's owner (a fork of a replaying fork points past its parent)."""
    record = read_run_record(layout)
    if iteration not in replayed_iterations(record):
        return layout
    parent = parent_of(record)
    return rollout_owner(RunLayout(parent["root"], parent["run"], layout.storage_cfg), iteration)


def stage_record(layout: RunLayout, iteration: int, stage: str) -> Optional[dict[str, Any]]:
    """`<run>/iter-NNNNNN/_stages/<stage>.json` (storage/stage_records.py), for the storage and engine layers that
    read another run's records: a replayed iteration's rollout and score manifests. None when absent."""
    return read_stage_record(layout, iteration, stage)


def own_first_iteration(layout: RunLayout) -> int:
    """The first iteration a run computed itself: its fork point + 1 for a fork, else 1."""
    parent = parent_of(read_run_record(layout))
    return 1 if parent is None else int(parent["iteration"]) + 1
