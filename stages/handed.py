"""Reading what a stage is handed: the shards at a hand-off's `uri`, and only if they are the ones it names.

    open_handed(storage_cfg, handed, stage, iteration) -> (fs, path, shard manifest)   the folder, checked
    read_handed(storage_cfg, handed, stage, iteration) -> rows                         its rows, verified

A stage's Prefect cache key is made of its inputs' content hashes (tasks/cache_keys.py), so what a stage reads
must have exactly the hash it was handed: a folder rewritten after the stage that made it (a second writer of
that stage, or a hand) would otherwise be trained on under a key that names other rows. Every stage body that
takes a ShardsManifest (score: the rollout; update and each of its ranks: the scored shards; the rollout merge:
the parts; a replay's rescoring: the parent's scored shards) reads through here, at the hand-off's `uri`: never a
path rebuilt from the run and the iteration, so a fork replaying its parent's rollout reads the parent's folder in
place, as the hand-off names it.

The check costs one small JSON read: the shard manifest found at `uri` must have the hand-off's content_hash, and
the rows are then read against that very manifest (each part's size and sha256, storage/shards.py), so they are
the rows the hash names even if the folder is rewritten while they are read.
"""

from __future__ import annotations

from typing import Optional, Sequence

import fsspec
import pyarrow as pa

from stages.manifests import ShardsManifest
from storage.fs import resolve
from storage.shards import Manifest, NotCommittedError, read_shards, require_manifest


class HandedShardsError(ValueError):
    """The folder a hand-off names is gone (or not committed) or holds other shards than the hand-off names."""


def open_handed(
    storage_cfg, handed: ShardsManifest, stage: str, iteration: int, moved_to: Optional[str] = None
) -> tuple[fsspec.AbstractFileSystem, str, Manifest]:
    """The filesystem and path of `handed.uri` and the shard manifest committed there, which has `handed`'s
    content_hash. `storage_cfg`: the run's StorageConfig (S3 endpoint and options for an s3:// uri); `stage`
    ("score", "update", "rollout merge"...) and `iteration`: the reader, for the error.

    Raises HandedShardsError naming the stage, the iteration, the folder, the expected and the found hash (or that
    none is committed there) and what to do; ShardCorruptError / SchemaMismatchError for an unreadable manifest.

    moved_to: where the reading run keeps that folder now (its layout's URL for the stage's folder). Used only when
    nothing is committed at `handed.uri` and the shards there have `handed`'s content hash: the run was moved to
    another root or bucket after the stage that made the folder, and the persisted hand-off still names the old
    place. The same content hash is the same rows, so that is no weaker a check."""
    fs, path = resolve(handed.uri, storage_cfg)
    found = _committed(fs, path)
    if found is None and moved_to is not None and moved_to != handed.uri:
        here_fs, here = resolve(moved_to, storage_cfg)
        there = _committed(here_fs, here)
        if there is not None and there.content_hash == handed.content_hash:
            return here_fs, here, there
    if found is None or found.content_hash != handed.content_hash:
        raise HandedShardsError(_refusal(handed, stage, iteration, found))
    return fs, path, found


def _committed(fs: fsspec.AbstractFileSystem, path: str) -> Optional[Manifest]:
    try:
        return require_manifest(fs, path)
    except NotCommittedError:
        return None


def read_handed(
    storage_cfg,
    handed: ShardsManifest,
    stage: str,
    iteration: int,
    columns: Optional[Sequence[str]] = None,
    *,
    moved_to: Optional[str] = None,
) -> pa.Table:
    """The rows of the shards `handed` names (optionally only `columns`), read at its uri after open_handed's check
    (or at `moved_to`, see there); each part verified against the checked manifest. Errors: open_handed's, then
    read_shards' naming a part."""
    fs, path, found = open_handed(storage_cfg, handed, stage, iteration, moved_to)
    return read_shards(fs, path, columns=columns, manifest=found)


def _refusal(handed: ShardsManifest, stage: str, iteration: int, found: Optional[Manifest]) -> str:
    made_by = f"the {handed.stage} stage of iteration {handed.iteration}"
    what = (
        "no committed shards are there (no _manifest.json: removed, moved or being rewritten)"
        if found is None
        else f"the shards there have content hash {found.content_hash}"
    )
    return (
        f"{stage} stage of iteration {iteration}: refusing the {handed.stage} shards it was handed at {handed.uri}: "
        f"{what}; {made_by} handed on content hash {handed.content_hash}. The folder was changed after that stage "
        f"made it (by a second writer of that stage, or by hand), and that stage's persisted result still names the "
        f"old shards, so a retry is handed them again. Put back the shards it names (same content hash), or go on "
        f"in a fork of the run's last committed iteration N (`ppoflow fork RUN --at N --name NEW`; none committed yet: "
        f"start again under another run.name), whose next iteration starts over from its first stage."
    )
