"""The score cache: reward components and reference log-probs by content hash, shared through storage.

    <root>/cache/score/<scorer fingerprint>/seg-<unix ns, 20 digits>-<random 12 hex>[-L<level>].arrow

Each `put_many` writes ONE immutable Arrow IPC segment under a unique name in one atomic write (a
single PUT on S3), so concurrent writers (threads, processes, machines) never tear or overwrite an
entry, and a reader sees a segment completely or not at all. Readers list the folder and load the
segments they have not seen yet. The same key written twice (two workers scoring the same pair) is
harmless: both values are equal by construction of the key.

Compaction keeps the folder to a few dozen segments however long the run (one put per iteration made a
new process list and read one segment per past iteration: 1.4 s per score stage after 2,000 iterations
on a local disk, a GET each on S3). When `compact_at` segments share a level, a writer merges the oldest
`compact_at` of them (duplicate keys dropped) into one segment of the next level, named with the oldest
input's time so eviction order holds, then deletes the inputs: every entry is rewritten once per level,
and there are log_{compact_at}(puts) levels. A crash between the write and the deletes leaves duplicates,
which the next merge of that level drops. Writers that merge at once must not multiply: the merged
segment's name is derived from its inputs' names, so two writers merging the same inputs write the same
name (the same entries), and a writer that finds an input already gone stops compacting (another writer is
merging it) without writing anything. (Before this rule, four writers each wrote their own copy, four
copies filled the next level, and so on: levels climbed past 20 in the concurrency test.)

Eviction is by total bytes: after a put, when the folder holds more than `max_bytes`, the oldest
segments (by the time in their name) are deleted until it fits. A reader that listed a segment which is
evicted or merged away before it reads it treats that segment's keys as misses. `max_bytes <= 0` disables
eviction. Unreadable segments are skipped (logged) rather than failing the score stage: a cache miss is
always safe. A process keeps the values of the segments it has read, log-probs as float32 arrays (4 bytes
each, as on disk), and forgets a segment's entries once a listing shows it gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from typing import Any, Iterator, Optional, Sequence

import fsspec
import numpy as np
import pyarrow as pa

from storage import fs as fsutil

log = logging.getLogger(__name__)

SEGMENT_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("reward_components", pa.string(), nullable=False),  # JSON object name -> float
        pa.field("ref_logprobs", pa.list_(pa.float32()), nullable=False),
    ]
)


def _check_value(key: str, value: Any) -> tuple[str, list[float]]:
    """The value as (components JSON, ref log-probs); ValueError naming the key when malformed."""
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("reward_components"), dict)
        or not isinstance(value.get("ref_logprobs"), (list, tuple))
    ):
        raise ValueError(
            f"score cache entry {key!r} must be {{'reward_components': {{name: float}}, "
            f"'ref_logprobs': [float, ...]}}, got {str(value)[:120]}"
        )
    try:
        components = {str(k): float(v) for k, v in value["reward_components"].items()}
        logprobs = [float(x) for x in value["ref_logprobs"]]
    except (TypeError, ValueError) as e:
        raise ValueError(f"score cache entry {key!r} holds a non-numeric value: {e}") from None
    return json.dumps(components, sort_keys=True), logprobs


_SEGMENT_NAME = re.compile(r"seg-(\d{20})-[0-9a-f]{12}(?:-L(\d+))?\.arrow")


def _segment_level(name: str) -> Optional[int]:
    """0 for a segment a put wrote, L for one merged L times over; None when `name` is not a segment."""
    m = _SEGMENT_NAME.fullmatch(name)
    return None if m is None else int(m.group(2) or 0)


def _new_segment_name(time_ns: int, level: int = 0) -> str:
    return f"seg-{time_ns:020d}-{uuid.uuid4().hex[:12]}" + (f"-L{level}" if level else "") + ".arrow"


def _merged_segment_name(inputs: list[str], level: int) -> str:
    """The name of the merge of `inputs` (oldest first): the oldest input's time, so eviction order holds,
    and a digest of the input names, so every writer merging the same inputs writes the same segment."""
    oldest = int(_SEGMENT_NAME.fullmatch(inputs[0]).group(1))
    digest = hashlib.sha256("\n".join(inputs).encode()).hexdigest()[:12]
    return f"seg-{oldest:020d}-{digest}-L{level}.arrow"


class _MergedElsewhere(Exception):
    """An input of a merge is gone: another writer merged (or evicted) it first."""


def _table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, SEGMENT_SCHEMA) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class ScoreCache:
    """Batched get/put of scores for one scorer (one folder). Thread-safe enough for one writer per call.

    compact_at: segments of one level that trigger a merge (module doc); 0 disables compaction.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, dir: str, max_bytes: int = 2 * 2**30, compact_at: int = 16):
        if compact_at == 1 or compact_at < 0:
            raise ValueError(f"compact_at={compact_at}: merging needs at least 2 segments (0 disables it)")
        self.fs = fs
        self.dir = dir.rstrip("/")
        self.max_bytes = max_bytes
        self.compact_at = compact_at
        self.hits = 0
        self.misses = 0
        # key -> (components JSON, float32 log-probs view, name of the segment it was last read from)
        self._entries: dict[str, tuple[str, np.ndarray, str]] = {}
        self._segment_keys: dict[str, list[str]] = {}  # segments read, and their keys
        self._seen_segments: set[str] = set()  # read, or skipped as unreadable

    def __repr__(self) -> str:
        return f"ScoreCache({fsutil.url_of(self.fs, self.dir)!r}, hits={self.hits}, misses={self.misses})"

    def __len__(self) -> int:
        """Entries held in this process's memory."""
        return len(self._entries)

    def _segment_sizes(self) -> dict[str, int]:
        return {
            name: size
            for name, size in fsutil.list_files(self.fs, self.dir).items()
            if "/" not in name and _segment_level(name) is not None
        }

    def _read_segment(self, name: str, missing_ok: bool = True) -> Optional[pa.Table]:
        """The segment's table; None when it is gone (evicted, merged) or unreadable (logged).
        missing_ok=False: a gone segment raises _MergedElsewhere instead."""
        path = fsutil.join(self.dir, name)
        try:
            table = pa.ipc.open_file(pa.BufferReader(fsutil.read_bytes(self.fs, path))).read_all()
            if not table.schema.equals(SEGMENT_SCHEMA):
                raise ValueError(f"schema {table.schema} is not the segment schema")
            return table
        except FileNotFoundError:
            if not missing_ok:
                raise _MergedElsewhere(name) from None
            return None  # evicted or merged between the listing and the read: its keys are misses
        except (pa.ArrowInvalid, OSError, ValueError) as e:
            log.warning("score cache: skipping unreadable segment %s: %s", fsutil.url_of(self.fs, path), e)
            self._seen_segments.add(name)
            return None

    def _load_segment(self, name: str) -> None:
        table = self._read_segment(name)
        if table is not None:
            self._remember(table, name)

    def _remember(self, table: pa.Table, name: str) -> None:
        """Hold the segment's entries: log-probs as views of one float32 array per record batch."""
        keys = table.column("key").to_pylist()
        components = table.column("reward_components").to_pylist()
        views: list[np.ndarray] = []
        for chunk in table.column("ref_logprobs").chunks:
            values = chunk.flatten().to_numpy(zero_copy_only=False)
            ends = np.cumsum(chunk.value_lengths().to_numpy(zero_copy_only=False))
            views.extend(values[end - length : end] for end, length in zip(ends, np.diff(ends, prepend=0)))
        for key, comp, logprobs in zip(keys, components, views):
            self._entries[key] = (comp, logprobs, name)
        self._segment_keys[name] = keys
        self._seen_segments.add(name)

    def _forget_gone(self, listed: set[str]) -> None:
        """Drop what this process holds of segments no longer in the folder (evicted or merged away); an
        entry read since from a live segment (the merge's output) is kept."""
        for name in [n for n in self._segment_keys if n not in listed]:
            for key in self._segment_keys.pop(name):
                held = self._entries.get(key)
                if held is not None and held[2] == name:
                    del self._entries[key]
        self._seen_segments &= listed

    @staticmethod
    def _value(held: tuple[str, np.ndarray, str]) -> dict[str, Any]:
        return {"reward_components": json.loads(held[0]), "ref_logprobs": held[1].tolist()}

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(key, value) of every entry held in memory, values as `get_many` returns them."""
        for key, held in list(self._entries.items()):
            yield key, self._value(held)

    def refresh(self) -> None:
        """Load segments written since the last refresh (by this or any other writer); forget gone ones."""
        listed = set(self._segment_sizes())
        self._forget_gone(listed)
        for name in sorted(listed - self._seen_segments):
            self._load_segment(name)

    def get_many(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """{key: value} for the keys found; counts hits and misses. Loads new segments only when needed."""
        if any(k not in self._entries for k in keys):
            self.refresh()
        found = {k: self._value(self._entries[k]) for k in keys if k in self._entries}
        self.hits += len(found)
        self.misses += len(keys) - len(found)
        return found

    def put_many(self, entries: dict[str, dict[str, Any]]) -> Optional[str]:
        """Write `entries` as one new segment; returns its name (None when `entries` is empty).

        Values: {"reward_components": {name: float}, "ref_logprobs": [float, ...]}; a malformed value
        raises ValueError naming its key before anything is written. Compacts and evicts afterwards.
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
        name = _new_segment_name(time.time_ns())
        fsutil.write_bytes_atomic(self.fs, fsutil.join(self.dir, name), _table_bytes(table))
        self._remember(table, name)  # as float32, exactly what another reader of the segment gets
        # One listing serves compaction and eviction unless a merge changed the folder (on S3 a LIST each);
        # none when both are off.
        if self.compact_at or self.max_bytes > 0:
            sizes = self._segment_sizes()
            if self._compact(sizes):
                sizes = self._segment_sizes()
            self._evict(sizes)
        return name

    def compact(self) -> list[str]:
        """Merge segments level by level while a level holds `compact_at` of them; returns the new names."""
        return self._compact(self._segment_sizes())

    def _compact(self, sizes: dict[str, int]) -> list[str]:
        made: list[str] = []
        while self.compact_at:
            by_level: dict[int, list[str]] = {}
            for name in sorted(sizes):  # oldest first
                by_level.setdefault(_segment_level(name), []).append(name)
            full = [level for level, names in sorted(by_level.items()) if len(names) >= self.compact_at]
            if not full:
                return made
            try:
                name = self._merge(by_level[full[0]][: self.compact_at], full[0] + 1)
            except _MergedElsewhere:
                return made  # another writer is merging this level; it finishes the job
            if name in made:
                return made  # its inputs are still listed (a delete that did not take): never loop on them
            if name is not None:
                made.append(name)
            sizes = self._segment_sizes()
        return made

    def _merge(self, names: list[str], level: int) -> Optional[str]:
        """One segment of `level` holding the entries of `names` (each key once), then `names` deleted
        (unreadable ones too: they would fill the level again forever). None when none could be read.
        Raises _MergedElsewhere, having written and deleted nothing, when one of `names` is gone."""
        tables = [t for t in (self._read_segment(n, missing_ok=False) for n in names) if t is not None]
        name = None
        if tables:
            merged = pa.concat_tables(tables)
            first: dict[str, int] = {}
            for i, key in enumerate(merged.column("key").to_pylist()):
                first.setdefault(key, i)
            if len(first) < merged.num_rows:
                merged = merged.take(pa.array(sorted(first.values()), pa.int64()))
            name = _merged_segment_name(names, level)
            fsutil.write_bytes_atomic(self.fs, fsutil.join(self.dir, name), _table_bytes(merged))
            self._remember(merged, name)
        fsutil.remove_files(self.fs, [fsutil.join(self.dir, old) for old in names])  # gone already: merged elsewhere
        self._forget_gone(set(self._seen_segments) - set(names))
        return name

    def evict(self) -> list[str]:
        """Delete the oldest segments until the folder holds at most `max_bytes`; returns their names."""
        return self._evict(self._segment_sizes()) if self.max_bytes > 0 else []

    def _evict(self, sizes: dict[str, int]) -> list[str]:
        if self.max_bytes <= 0:
            return []
        total = sum(sizes.values())
        removed = []
        for name in sorted(sizes):  # names start with the creation time (a merge's, its oldest input's)
            if total <= self.max_bytes:
                break
            total -= sizes[name]
            removed.append(name)
        fsutil.remove_files(
            self.fs, [fsutil.join(self.dir, name) for name in removed]
        )  # gone already: evicted elsewhere
        return removed

    def total_bytes(self) -> int:
        return sum(self._segment_sizes().values())
