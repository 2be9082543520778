"""Arrow shards and manifests: one set of test bodies, run on a local folder and on the moto S3 server."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pytest

import storage.shards as shards
from storage.fs import list_files, resolve, write_bytes_atomic
from storage.layout import RunLayout
from storage.schema import SCHEMA_VERSION, SchemaMismatchError
from storage.synthetic import synthetic_table


@pytest.fixture
def layout(storage_root):
    root, cfg = storage_root
    return RunLayout(root, "run-a", cfg)


def test_round_trip_parts_manifest_and_columns(layout):
    table = synthetic_table("scored", 300, seed=1)
    stage = layout.stage_dir(1, "scored")
    manifest = shards.write_shards(layout.fs, stage, table, "scored", max_rows=100)

    # 300 rows at <= 100 per part: exactly 3 parts, 100 rows each.
    assert [p.name for p in manifest.parts] == [f"part-0000{i}-of-00003.arrow" for i in range(3)]
    assert [p.rows for p in manifest.parts] == [100, 100, 100] and manifest.rows == 300
    # single-turn rows keep version 1 (storage/schema.py: the lowest version that describes them)
    assert manifest.kind == "scored" and manifest.schema_version == 1 < SCHEMA_VERSION
    assert set(list_files(layout.fs, stage)) == {p.name for p in manifest.parts} | {"_manifest.json"}
    for part in manifest.parts:  # the manifest's hashes and sizes match the stored bytes, hashed here
        data = layout.fs.cat_file(f"{stage}/{part.name}")
        assert (len(data), hashlib.sha256(data).hexdigest()) == (part.bytes, part.sha256)
    assert manifest.bytes == sum(p.bytes for p in manifest.parts)

    assert shards.read_shards(layout.fs, stage).equals(table)
    subset = shards.read_shards(layout.fs, stage, columns=["response_ids", "reward"])
    assert subset.equals(table.select(["response_ids", "reward"]))
    assert shards.read_manifest(layout.fs, stage) == manifest
    assert json.loads(json.dumps(manifest.to_dict()))["rows"] == 300


def test_content_hash_follows_content(layout):
    table = synthetic_table("rollout", 50, seed=2)
    first = shards.write_shards(layout.fs, layout.stage_dir(1, "rollout"), table, "rollout")
    again = shards.write_shards(layout.fs, layout.stage_dir(2, "rollout"), table, "rollout")
    other = shards.write_shards(
        layout.fs, layout.stage_dir(3, "rollout"), synthetic_table("rollout", 50, seed=3), "rollout"
    )
    assert first.content_hash == again.content_hash != other.content_hash


def test_empty_table_gives_one_empty_part_with_the_schema(layout):
    stage = layout.stage_dir(1, "rollout")
    manifest = shards.write_shards(layout.fs, stage, synthetic_table("rollout", 0), "rollout")
    assert manifest.rows == 0 and [p.name for p in manifest.parts] == ["part-00000-of-00001.arrow"]
    table = shards.read_shards(layout.fs, stage)
    assert table.num_rows == 0 and table.schema.names[:3] == ["iteration", "prompt_index", "sample_index"]


def _is_multipart_etag(layout, path) -> bool:
    # S3 gives a multipart object an ETag "<md5 of part md5s>-<part count>"; a single PUT has no dash.
    return "-" in layout.fs.info(path)["ETag"].strip('"')


def test_large_parts_on_both_sides_of_the_multipart_threshold(layout, storage_root):
    # ~4 KiB per row (response up to 1024 ids + log-probs): 6000 rows ~ 24 MiB in 2 parts of ~12 MiB,
    # above the fixture's multipart threshold of 2 x 5 MiB; the 100-row table stays far below it.
    large = synthetic_table("rollout", 6000, seed=4, response_len=1024)
    small = synthetic_table("rollout", 100, seed=5, response_len=1024)
    big_stage, small_stage = layout.stage_dir(1, "rollout"), layout.stage_dir(2, "rollout")
    big = shards.write_shards(layout.fs, big_stage, large, "rollout", max_bytes=16 * 2**20)
    little = shards.write_shards(layout.fs, small_stage, small, "rollout")
    assert len(big.parts) == 2 and all(p.bytes > 10 * 2**20 for p in big.parts)
    assert little.parts[0].bytes < 10 * 2**20
    assert shards.read_shards(layout.fs, big_stage).equals(large)
    assert shards.read_shards(layout.fs, small_stage).equals(small)
    if storage_root[0].startswith("s3://"):
        assert all(_is_multipart_etag(layout, f"{big_stage}/{p.name}") for p in big.parts)
        assert not _is_multipart_etag(layout, f"{small_stage}/{little.parts[0].name}")


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
def test_damaged_part_is_named_in_the_error(layout, damage):
    stage = layout.stage_dir(1, "scored")
    manifest = shards.write_shards(layout.fs, stage, synthetic_table("scored", 90, seed=6), "scored", max_rows=30)
    victim = f"{stage}/{manifest.parts[1].name}"
    data = layout.fs.cat_file(victim)
    if damage == "truncated":
        write_bytes_atomic(layout.fs, victim, data[: len(data) // 2])
    elif damage == "flipped":
        middle = len(data) // 2
        write_bytes_atomic(layout.fs, victim, data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    else:
        layout.fs.rm_file(victim)
    expected_word = {"truncated": "truncated", "flipped": "sha256", "missing": "missing"}[damage]
    with pytest.raises(shards.ShardCorruptError, match=expected_word) as err:
        shards.read_shards(layout.fs, stage)
    assert "part-00001-of-00003.arrow" in str(err.value)


def test_missing_manifest_reads_as_not_committed(layout):
    stage = layout.stage_dir(1, "rollout")
    assert shards.read_manifest(layout.fs, stage) is None  # folder does not exist at all
    shards.write_shards(layout.fs, stage, synthetic_table("rollout", 10), "rollout")
    layout.fs.rm_file(f"{stage}/_manifest.json")
    assert shards.read_manifest(layout.fs, stage) is None
    with pytest.raises(shards.NotCommittedError, match="not committed"):
        shards.read_shards(layout.fs, stage)


def test_crash_between_parts_and_manifest_keeps_previous_state(layout, monkeypatch):
    committed = synthetic_table("rollout", 40, seed=7)
    shards.write_shards(layout.fs, layout.stage_dir(1, "rollout"), committed, "rollout", max_rows=10)
    stage2 = layout.stage_dir(2, "rollout")

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("injected crash after the parts, before the manifest")

    monkeypatch.setattr(shards, "_commit_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        shards.write_shards(layout.fs, stage2, synthetic_table("rollout", 40, seed=8), "rollout", max_rows=10)
    monkeypatch.undo()

    assert len(list_files(layout.fs, stage2)) == 4  # the four parts landed ...
    assert shards.read_manifest(layout.fs, stage2) is None  # ... but nothing is committed
    with pytest.raises(shards.NotCommittedError):
        shards.read_shards(layout.fs, stage2)
    assert shards.read_shards(layout.fs, layout.stage_dir(1, "rollout")).equals(committed)

    # The retry (with another part count) replaces the uncommitted output: no stale or duplicate parts.
    retry = synthetic_table("rollout", 40, seed=8)
    manifest = shards.write_shards(layout.fs, stage2, retry, "rollout", max_rows=20)
    assert set(list_files(layout.fs, stage2)) == {
        "part-00000-of-00002.arrow",
        "part-00001-of-00002.arrow",
        "_manifest.json",
    }
    assert manifest.rows == 40 and shards.read_shards(layout.fs, stage2).equals(retry)


def test_schema_errors_name_the_column(layout):
    table = synthetic_table("rollout", 5)
    widened = table.set_column(0, "iteration", table.column("iteration").cast(pa.int64()))
    with pytest.raises(SchemaMismatchError, match=r"'iteration' has type int64, expected int32"):
        shards.write_shards(layout.fs, layout.stage_dir(1, "rollout"), widened, "rollout")
    with pytest.raises(SchemaMismatchError, match=r"'reward' is missing"):
        shards.write_shards(layout.fs, layout.stage_dir(1, "scored"), table, "scored")

    stage = layout.stage_dir(2, "rollout")
    shards.write_shards(layout.fs, stage, table, "rollout")
    with pytest.raises(SchemaMismatchError, match="'advantages'"):
        shards.read_shards(layout.fs, stage, columns=["advantages"])
    record = json.loads(layout.fs.cat_file(f"{stage}/_manifest.json"))
    record["schema_version"] = SCHEMA_VERSION + 1
    write_bytes_atomic(layout.fs, f"{stage}/_manifest.json", json.dumps(record).encode())
    with pytest.raises(SchemaMismatchError, match=f"schema version {SCHEMA_VERSION + 1}"):
        shards.read_shards(layout.fs, stage)


def test_resolve_round_trips_urls(layout):
    fs, path = resolve(layout.url(layout.run_dir), layout.storage_cfg)
    assert path == layout.run_dir and type(fs) is type(layout.fs)
