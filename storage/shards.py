"""Arrow shards: a stage's table as bounded parts plus a manifest that commits them.

On-disk format, one folder per stage (e.g. <run>/iter-000003/rollout/):
    part-00000-of-00004.arrow ... part-00003-of-00004.arrow   Arrow IPC *file* format, one part per PUT
    _manifest.json                                             written LAST: the commit

Why the IPC file format (not the stream format): it is what `pyarrow.dataset(..., format="arrow")`
reads, and `datasets.load_dataset("arrow", data_files=...)` reads both. (`datasets.Dataset.from_file`
reads only the stream format its own cache uses, so it does not open these parts; use load_dataset.)

Commit protocol: `write_shards` first removes whatever the folder held (manifest first, so a crash
during clean-up leaves "not committed", never a manifest listing deleted parts), writes every part in
one atomic write, then the manifest. Readers trust only what a manifest lists: a folder without one is
"not committed" (NotCommittedError), and each listed part is checked against its size and sha256.
A retried write therefore replaces its own uncommitted output and never duplicates rows; other
folders are never touched.

Each part describes itself: its Arrow schema metadata holds `ppoflow.kind` and `ppoflow.schema_version`,
plus what the writer passes (`shard_metadata`: run name, iteration, stage, config hash, ppoflow version),
so a part copied alone still says where it came from (`pyarrow.ipc.open_file(f).schema.metadata`).

No streaming writer: a part's name carries the total part count ("-of-00004"), which is known only at
the end, and renaming afterwards is not atomic on S3. Stages hold their (small) table in memory anyway.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import fsspec
import pyarrow as pa

from storage import fs as fsutil
from storage.schema import (
    MULTI_TURN_COLUMNS,
    MULTI_TURN_VERSION,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    SchemaMismatchError,
    check_columns,
    schema_for,
    schema_like,
    validate,
    version_of,
)

METADATA_PREFIX = "ppoflow."
MANIFEST_NAME = "_manifest.json"
MANIFEST_FORMAT = "ppoflow.shards"
_BATCH_ROWS = 1024  # record batch size inside a part: datasets reads a part batch by batch
_READ_CHUNK = 8 * 2**20  # local reads: hash chunk i while reading chunk i + 1


class NotCommittedError(FileNotFoundError):
    """The folder has no manifest: its stage never committed (or is being rewritten)."""


class ShardCorruptError(IOError):
    """A part listed by a manifest is missing, truncated, fails its hash or cannot be parsed; names the part."""


@dataclass(frozen=True)
class PartInfo:
    name: str  # file name inside the stage folder
    rows: int
    bytes: int
    sha256: str  # hex digest of the part's bytes


@dataclass(frozen=True)
class Manifest:
    """What a stage folder holds. `uri` is where it was read from or written to (not stored in the file)."""

    kind: str
    schema_version: int
    rows: int
    bytes: int
    parts: tuple[PartInfo, ...] = field(default_factory=tuple)
    uri: str = ""

    @property
    def content_hash(self) -> str:
        """sha256 over kind, schema version and the parts' hashes: equal data gives an equal hash."""
        h = hashlib.sha256(f"{self.kind}\0{self.schema_version}".encode())
        for part in self.parts:
            h.update(f"\0{part.name}\0{part.sha256}".encode())
        return h.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (a few KB even for hundreds of parts); what stage tasks hand to Prefect."""
        return {
            "format": MANIFEST_FORMAT,
            "kind": self.kind,
            "schema_version": self.schema_version,
            "rows": self.rows,
            "bytes": self.bytes,
            "content_hash": self.content_hash,
            "columns": schema_for(self.kind).names if self.kind in ("rollout", "scored", "experience") else [],
            "parts": [vars(p).copy() for p in self.parts],
            "uri": self.uri,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], uri: str = "") -> "Manifest":
        """Raises KeyError/TypeError/ValueError on a malformed dict (callers turn it into ShardCorruptError)."""
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {data.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        parts = tuple(
            PartInfo(str(p["name"]), int(p["rows"]), int(p["bytes"]), str(p["sha256"])) for p in data["parts"]
        )
        return cls(
            kind=str(data["kind"]),
            schema_version=int(data["schema_version"]),
            rows=int(data["rows"]),
            bytes=int(data["bytes"]),
            parts=parts,
            uri=uri or str(data.get("uri", "")),
        )


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}.arrow"


def serialize_part(table: pa.Table) -> pa.Buffer:
    """One Arrow IPC file (uncompressed, record batches of up to 1024 rows) in memory.

    Sized exactly first with a MockOutputStream (counts bytes, copies nothing), then written into a
    buffer of that size: a growing BufferOutputStream re-copies itself and was ~20x slower here.
    """
    mock = pa.MockOutputStream()
    with pa.ipc.new_file(mock, table.schema) as writer:
        writer.write_table(table, max_chunksize=_BATCH_ROWS)
    buffer = pa.allocate_buffer(mock.size())
    with pa.ipc.new_file(pa.FixedSizeBufferWriter(buffer), table.schema) as writer:
        writer.write_table(table, max_chunksize=_BATCH_ROWS)
    return buffer


def _sha256_hex(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_hashing(fs: fsspec.AbstractFileSystem, path: str, buffer: pa.Buffer) -> str:
    """Write `buffer` atomically while a second thread hashes it (both release the GIL); returns the sha256."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        digest = pool.submit(_sha256_hex, buffer)
        fsutil.write_bytes_atomic(fs, path, buffer)
        return digest.result()


def _read_local_hashing(path: str, verify: bool) -> tuple[memoryview, Optional[str]]:
    """Read a local file in chunks while one worker thread hashes the chunks already read, in order.

    The target is an Arrow-allocated buffer: aligned, not zero-filled, and parsed without a copy
    (a bytearray's zero-fill alone cost more than the read here).
    """
    size = os.path.getsize(path)
    data = memoryview(pa.allocate_buffer(size))
    digest = hashlib.sha256()
    position = 0
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(max_workers=1) as pool:
        while position < size:
            count = f.readinto(data[position : position + _READ_CHUNK])
            if not count:
                break  # the file shrank since stat(): the size check reports it
            if verify:
                pool.submit(digest.update, data[position : position + count])  # one worker: in order
            position += count
    return data[:position], (digest.hexdigest() if verify else None)


def plan_parts(num_rows: int, nbytes: int, max_rows: int, max_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each part: equal-sized parts, each within max_rows and ~max_bytes.

    Bytes are estimated from the table's average row size, so a part may exceed max_bytes when row
    sizes vary. An empty table still gets one (empty) part, so readers find its schema.
    """
    if max_rows < 1 or max_bytes < 1:
        raise ValueError(f"max_rows and max_bytes must be >= 1 (got {max_rows}, {max_bytes})")
    if num_rows == 0:
        return [(0, 0)]
    row_bytes = max(nbytes / num_rows, 1.0)
    rows_per_part = max(1, min(max_rows, int(max_bytes // row_bytes)))
    count = math.ceil(num_rows / rows_per_part)
    base, extra = divmod(num_rows, count)
    plan, offset = [], 0
    for i in range(count):
        length = base + (1 if i < extra else 0)
        plan.append((offset, length))
        offset += length
    return plan


def clear_stage_dir(fs: fsspec.AbstractFileSystem, stage_dir: str) -> None:
    """Uncommit, then empty, a stage folder: the manifest goes first."""
    manifest_path = fsutil.join(stage_dir, MANIFEST_NAME)
    if fsutil.exists(fs, manifest_path):
        fs.rm_file(manifest_path)
    fsutil.remove_tree(fs, stage_dir)


def _commit_manifest(fs: fsspec.AbstractFileSystem, stage_dir: str, manifest: Manifest) -> None:
    record = manifest.to_dict()
    record.pop("uri")  # where a folder lives is not part of its content: folders can be copied
    fsutil.write_json(fs, fsutil.join(stage_dir, MANIFEST_NAME), record)


def ppoflow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ppoflow")
    except PackageNotFoundError:
        return "unknown"


def shard_metadata(cfg, iteration: int, stage: str) -> dict[str, str]:
    """The schema metadata a stage passes to `write_shards`: run name, iteration, stage, config hash, version.

    `cfg` is a PPOFlowConfig. The config hash is the one `RunLayout.write_config_once` names in a config
    conflict (sha256 of the resolved config, 16 hex digits), so a part can be matched to its config.yaml.
    """
    from storage.layout import _config_hash

    # The JSON dump is what config.yaml holds (to_yaml dumps it; YAML gives the same values back), without
    # the YAML round trip (~10 ms, three times an iteration).
    return {
        "ppoflow.run": cfg.run.name,
        "ppoflow.iteration": str(int(iteration)),
        "ppoflow.stage": str(stage),
        "ppoflow.config_hash": _config_hash(cfg.model_dump(mode="json")),
        "ppoflow.version": ppoflow_version(),
    }


def _schema_metadata(kind: str, metadata: Optional[dict[str, str]], version: int) -> dict[str, str]:
    """kind and schema version, then the caller's keys; ValueError for a key without the prefix or a non-str."""
    out = {"ppoflow.kind": kind, "ppoflow.schema_version": str(version)}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not key.startswith(METADATA_PREFIX) or not isinstance(value, str):
            raise ValueError(
                f"shard metadata {key!r}: {value!r}: keys must be strings starting with "
                f"{METADATA_PREFIX!r} and values strings"
            )
        out[key] = value
    return out


def write_shards(
    fs: fsspec.AbstractFileSystem,
    stage_dir: str,
    table: pa.Table,
    kind: str,
    max_rows: int = 4096,
    max_bytes: int = 256 * 2**20,
    metadata: Optional[dict[str, str]] = None,
) -> Manifest:
    """Replace the contents of `stage_dir` with `table` as parts plus a manifest (written last).

    `table` must match `kind`'s schema (storage/schema.py): SchemaMismatchError otherwise, raised
    before anything is removed. `metadata` (keys prefixed "ppoflow.", string values; see
    `shard_metadata`) goes into every part's Arrow schema metadata beside `ppoflow.kind` and
    `ppoflow.schema_version`; ValueError for another key. Returns the manifest (rows, bytes, part
    hashes, content_hash).
    """
    # The lowest version that describes the rows (storage/schema.py): single-turn shards stay version 1.
    version = version_of(table)
    schema_metadata = _schema_metadata(kind, metadata, version)
    table = validate(table, kind, where=f"shards for {fsutil.url_of(fs, stage_dir)}")
    table = table.replace_schema_metadata(schema_metadata)
    clear_stage_dir(fs, stage_dir)
    plan = plan_parts(table.num_rows, table.nbytes, max_rows, max_bytes)
    parts = []
    for index, (offset, length) in enumerate(plan):
        name = part_name(index, len(plan))
        buffer = serialize_part(table.slice(offset, length))
        digest = _write_hashing(fs, fsutil.join(stage_dir, name), buffer)
        parts.append(PartInfo(name=name, rows=length, bytes=buffer.size, sha256=digest))
    manifest = Manifest(
        kind=kind,
        schema_version=version,
        rows=table.num_rows,
        bytes=sum(p.bytes for p in parts),
        parts=tuple(parts),
        uri=fsutil.url_of(fs, stage_dir),
    )
    _commit_manifest(fs, stage_dir, manifest)
    return manifest


def read_manifest(fs: fsspec.AbstractFileSystem, stage_dir: str) -> Optional[Manifest]:
    """The folder's manifest, or None when it has none (not committed).

    Raises ShardCorruptError naming the manifest when it exists but cannot be parsed.
    """
    path = fsutil.join(stage_dir, MANIFEST_NAME)
    url = fsutil.url_of(fs, path)
    try:
        data = fsutil.read_json(fs, path)
    except ValueError as e:
        raise ShardCorruptError(str(e)) from None
    if data is None:
        return None
    try:
        return Manifest.from_dict(data, uri=fsutil.url_of(fs, stage_dir))
    except (KeyError, TypeError, ValueError) as e:
        raise ShardCorruptError(f"{url} is not a valid shard manifest: {type(e).__name__}: {e}") from None


def require_manifest(fs: fsspec.AbstractFileSystem, stage_dir: str) -> Manifest:
    """Like read_manifest, but NotCommittedError when absent and SchemaMismatchError on another schema version."""
    manifest = read_manifest(fs, stage_dir)
    url = fsutil.url_of(fs, stage_dir)
    if manifest is None:
        raise NotCommittedError(
            f"{url} is not committed: no {MANIFEST_NAME} (its stage never finished, or is being rewritten)"
        )
    if manifest.schema_version not in READABLE_VERSIONS:
        raise SchemaMismatchError(
            f"{url}: shards have schema version {manifest.schema_version}, this ppoflow reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} (writes up to {SCHEMA_VERSION})"
        )
    schema_for(manifest.kind)  # unknown kind -> ValueError naming it
    return manifest


def read_part(
    fs: fsspec.AbstractFileSystem, stage_dir: str, part: PartInfo, kind: str, verify: bool = True
) -> pa.Table:
    """One verified part as a table. Raises ShardCorruptError / SchemaMismatchError naming the part."""
    path = fsutil.join(stage_dir, part.name)
    url = fsutil.url_of(fs, path)
    try:
        if fsutil.is_local(fs):
            data, digest = _read_local_hashing(path, verify)
        else:
            data = fsutil.read_bytes(fs, path)
            digest = _sha256_hex(data) if verify else None
    except FileNotFoundError:
        raise ShardCorruptError(f"part {url} is listed in the manifest but missing") from None
    if len(data) != part.bytes:
        raise ShardCorruptError(f"part {url} is truncated or resized: {len(data)} bytes, manifest says {part.bytes}")
    if verify and digest != part.sha256:
        raise ShardCorruptError(f"part {url} fails its sha256 check (content differs from what was committed)")
    try:
        table = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(data))).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ShardCorruptError(f"part {url} is not a readable Arrow IPC file: {e}") from None
    if not table.schema.equals(schema_like(kind, table)):
        table = validate(table, kind, where=f"part {url}")  # raises with the column's name and types
    if table.num_rows != part.rows:
        raise ShardCorruptError(f"part {url} holds {table.num_rows} rows, manifest says {part.rows}")
    return table


def read_shards(
    fs: fsspec.AbstractFileSystem,
    stage_dir: str,
    columns: Optional[Sequence[str]] = None,
    verify: bool = True,
    manifest: Optional[Manifest] = None,
) -> pa.Table:
    """The committed table of `stage_dir` (only the listed parts), optionally only some columns.

    manifest: the folder's manifest as the caller read it (require_manifest) and checked: the parts it lists are
    read and each verified against it, so the table is the one that manifest's content_hash names even if the
    folder is rewritten meanwhile (a part replaced since fails its check). None: read the folder's manifest here.
    Raises NotCommittedError (no manifest), ShardCorruptError (a part missing, truncated, hash
    mismatch, unreadable; names the part), SchemaMismatchError (other schema version or columns).
    """
    manifest = manifest or require_manifest(fs, stage_dir)
    selected = check_columns(manifest.kind, columns)
    if selected is not None and manifest.schema_version < MULTI_TURN_VERSION:
        missing = [c for c in selected if c in MULTI_TURN_COLUMNS]
        if missing:
            raise SchemaMismatchError(
                f"{fsutil.url_of(fs, stage_dir)}: columns {missing} are in multi-turn shards only (schema version "
                f"{MULTI_TURN_VERSION}); these are single-turn (version {manifest.schema_version})"
            )
    tables = []
    for part in manifest.parts:
        table = read_part(fs, stage_dir, part, manifest.kind, verify=verify)
        tables.append(table.select(selected) if selected is not None else table)
    if not tables:
        schema = schema_for(manifest.kind, manifest.schema_version >= MULTI_TURN_VERSION)
        empty = schema.empty_table()
        return empty.select(selected) if selected is not None else empty
    return pa.concat_tables(tables)
