"""The score cache: reward components and reference log-probs by content hash, shared through storage.

    <root>/cache/score/<scorer fingerprint>/seg-<unix ns, 20 digits>-<random 12 hex>.arrow

Each `put_many` writes ONE immutable Arrow IPC segment under a unique name in one atomic write (a
single PUT on S3), so concurrent writers (threads, processes, machines) never tear or overwrite an
entry, and a reader sees a segment completely or not at all. Readers list the folder and load the
segments they have not seen yet. The same key written twice (two workers scoring the same pair) is
harmless: both values are equal by construction of the key.

Eviction is by total bytes: after a put, when the folder holds more than `max_bytes`, the oldest
segments (by the time in their name) are deleted until it fits. A reader that listed a segment which is
evicted before it reads it treats that segment's keys as misses. `max_bytes <= 0` disables eviction.
Unreadable segments are skipped (logged) rather than failing the score stage: a cache miss is always
safe. Values read are kept in this process's memory (bounded by the folder's size).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Optional, Sequence

import fsspec
import pyarrow as pa

from storage import fs as fsutil

log = logging.getLogger(__name__)

SEGMENT_SCHEMA = pa.schema([
    pa.field("key", pa.string(), nullable=False),
    pa.field("reward_components", pa.string(), nullable=False),  # JSON object name -> float
    pa.field("ref_logprobs", pa.list_(pa.float32()), nullable=False),
])


def _check_value(key: str, value: Any) -> tuple[str, list[float]]:
    """The value as (components JSON, ref log-probs); ValueError naming the key when malformed."""
    if not isinstance(value, dict) or not isinstance(value.get("reward_components"), dict) \
            or not isinstance(value.get("ref_logprobs"), (list, tuple)):
        raise ValueError(f"score cache entry {key!r} must be {{'reward_components': {{name: float}}, "
                         f"'ref_logprobs': [float, ...]}}, got {str(value)[:120]}")
    try:
        components = {str(k): float(v) for k, v in value["reward_components"].items()}
        logprobs = [float(x) for x in value["ref_logprobs"]]
    except (TypeError, ValueError) as e:
        raise ValueError(f"score cache entry {key!r} holds a non-numeric value: {e}") from None
    return json.dumps(components, sort_keys=True), logprobs


class ScoreCache:
    """Batched get/put of scores for one scorer (one folder). Thread-safe enough for one writer per call."""

    def __init__(self, fs: fsspec.AbstractFileSystem, dir: str, max_bytes: int = 2 * 2**30):
        self.fs = fs
        self.dir = dir.rstrip("/")
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._entries: dict[str, dict[str, Any]] = {}
        self._seen_segments: set[str] = set()

    def __repr__(self) -> str:
        return f"ScoreCache({fsutil.url_of(self.fs, self.dir)!r}, hits={self.hits}, misses={self.misses})"

    def _segment_sizes(self) -> dict[str, int]:
        return {name: size for name, size in fsutil.list_files(self.fs, self.dir).items()
                if name.startswith("seg-") and name.endswith(".arrow") and "/" not in name}

    def _load_segment(self, name: str) -> None:
        path = fsutil.join(self.dir, name)
        try:
            table = pa.ipc.open_file(pa.BufferReader(fsutil.read_bytes(self.fs, path))).read_all()
            if not table.schema.equals(SEGMENT_SCHEMA):
                raise ValueError(f"schema {table.schema} is not the segment schema")
        except FileNotFoundError:
            return  # evicted between the listing and the read: its keys are misses
        except (pa.ArrowInvalid, OSError, ValueError) as e:
            log.warning("score cache: skipping unreadable segment %s: %s", fsutil.url_of(self.fs, path), e)
            self._seen_segments.add(name)
            return
        self._remember(table)
        self._seen_segments.add(name)

    def _remember(self, table: pa.Table) -> None:
        columns = table.to_pydict()
        for key, components, logprobs in zip(columns["key"], columns["reward_components"], columns["ref_logprobs"]):
            self._entries[key] = {"reward_components": json.loads(components), "ref_logprobs": logprobs}

    def refresh(self) -> None:
        """Load segments written since the last refresh (by this or any other writer)."""
        for name in sorted(self._segment_sizes()):
            if name not in self._seen_segments:
                self._load_segment(name)

    def get_many(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """{key: value} for the keys found; counts hits and misses. Loads new segments only when needed."""
        if any(k not in self._entries for k in keys):
            self.refresh()
        found = {k: self._entries[k] for k in keys if k in self._entries}
        self.hits += len(found)
        self.misses += len(keys) - len(found)
        return found

    def put_many(self, entries: dict[str, dict[str, Any]]) -> Optional[str]:
        """Write `entries` as one new segment; returns its name (None when `entries` is empty).

        Values: {"reward_components": {name: float}, "ref_logprobs": [float, ...]}; a malformed value
        raises ValueError naming its key before anything is written. Evicts old segments afterwards.
        """
        if not entries:
            return None
        rows = {"key": [], "reward_components": [], "ref_logprobs": []}
        for key, value in entries.items():
            components_json, logprobs = _check_value(key, value)
            rows["key"].append(key)
            rows["reward_components"].append(components_json)
            rows["ref_logprobs"].append(logprobs)
        table = pa.table(rows, schema=SEGMENT_SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, SEGMENT_SCHEMA) as writer:
            writer.write_table(table)
        name = f"seg-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.arrow"
        fsutil.write_bytes_atomic(self.fs, fsutil.join(self.dir, name), sink.getvalue())
        self._remember(table)  # as float32, exactly what another reader of the segment gets
        self._seen_segments.add(name)
        self.evict()
        return name

    def evict(self) -> list[str]:
        """Delete the oldest segments until the folder holds at most `max_bytes`; returns their names."""
        if self.max_bytes <= 0:
            return []
        sizes = self._segment_sizes()
        total = sum(sizes.values())
        removed = []
        for name in sorted(sizes):  # names start with the creation time: oldest first
            if total <= self.max_bytes:
                break
            try:
                self.fs.rm_file(fsutil.join(self.dir, name))
            except FileNotFoundError:
                pass  # another writer evicted it first
            total -= sizes[name]
            removed.append(name)
        return removed

    def total_bytes(self) -> int:
        return sum(self._segment_sizes().values())
