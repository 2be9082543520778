"""The score cache on a local folder and on the moto S3 server: round trip, eviction, concurrent writers."""

from __future__ import annotations

import hashlib
import multiprocessing
import threading

import pytest

from storage.fs import list_files, remove_files, resolve, write_bytes_atomic
from storage.layout import RunLayout
from storage.score_cache import ScoreCache, _segment_level


def value_for(key: str) -> dict:
    """An entry derived from its key alone, so any reader can tell a torn or mixed-up entry.

    The log-probs are multiples of 1/8, exact in float32, so they survive the float32 column unchanged.
    """
    seed = int(key[:8], 16)
    return {
        "reward_components": {"function": (seed % 1000) / 7, "length": float(seed % 3)},
        "ref_logprobs": [-(i + 1) / 8 for i in range(1 + seed % 17)],
    }


def keys_of(writer: int, batch: int, size: int = 20) -> list[str]:
    # The cache is key-agnostic (keys come from engines/scoring/cached.py); any distinct hex strings do.
    return [hashlib.sha256(f"scorer-w{writer}/{batch}/{i}".encode()).hexdigest() for i in range(size)]


@pytest.fixture
def cache_dir(storage_root):
    root, cfg = storage_root
    layout = RunLayout(root, "run-s", cfg)
    return layout, layout.score_cache_dir("scorer-abc")


def test_put_then_get_from_another_reader(cache_dir):
    layout, folder = cache_dir
    writer = ScoreCache(layout.fs, folder)
    entries = {k: value_for(k) for k in keys_of(0, 0)}
    writer.put_many(entries)
    reader = ScoreCache(layout.fs, folder)
    wanted = list(entries)[:5] + ["absent-key"]
    got = reader.get_many(wanted)
    assert got == {k: entries[k] for k in wanted[:5]}
    assert (reader.hits, reader.misses) == (5, 1)
    assert writer.put_many({}) is None


def test_malformed_value_names_the_key(cache_dir):
    layout, folder = cache_dir
    with pytest.raises(ValueError, match="'k1'"):
        ScoreCache(layout.fs, folder).put_many({"k0": value_for("00000000"), "k1": {"reward_components": 1.0}})
    assert list_files(layout.fs, folder) == {}  # nothing written


def test_eviction_removes_oldest_segments_first(cache_dir):
    layout, folder = cache_dir
    cache = ScoreCache(layout.fs, folder, max_bytes=0)  # no eviction while filling
    names = [cache.put_many({k: value_for(k) for k in keys_of(0, b)}) for b in range(5)]
    sizes = list_files(layout.fs, folder)
    # A cap that fits the two newest segments but not three: the three oldest must go.
    cap = sizes[names[3]] + sizes[names[4]] + min(sizes.values()) // 2
    capped = ScoreCache(layout.fs, folder, max_bytes=cap)
    assert capped.evict() == names[:3]
    assert set(list_files(layout.fs, folder)) == set(names[3:])
    fresh = ScoreCache(layout.fs, folder)
    assert len(fresh.get_many(keys_of(0, 0))) == 0 and len(fresh.get_many(keys_of(0, 4))) == 20


def test_unreadable_segment_is_a_miss_not_a_failure(cache_dir):
    layout, folder = cache_dir
    cache = ScoreCache(layout.fs, folder)
    cache.put_many({k: value_for(k) for k in keys_of(0, 0)})
    write_bytes_atomic(layout.fs, f"{folder}/seg-00000000000000000001-deadbeef0000.arrow", b"not arrow")
    reader = ScoreCache(layout.fs, folder)
    assert len(reader.get_many(keys_of(0, 0))) == 20


def _segment_rows(layout, folder, name) -> int:
    """Rows of one segment, read with pyarrow directly (not through ScoreCache)."""
    import pyarrow as pa

    with layout.fs.open(f"{folder}/{name}", "rb") as f:
        return pa.ipc.open_file(pa.BufferReader(f.read())).read_all().num_rows


def test_compaction_merges_each_full_level_into_one_segment_of_the_next(cache_dir):
    """compact_at=3 and 10 puts: the folder counts puts in base 3. 10 = 1*9 + 0*3 + 1, so one level-2
    segment (every entry of puts 1-9, named with put 1's time so eviction still takes it first) and one
    level-0 segment (put 10) remain; no entry is lost."""
    layout, folder = cache_dir
    cache = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=3)
    names = [cache.put_many({k: value_for(k) for k in keys_of(0, b)}) for b in range(10)]
    left = sorted(list_files(layout.fs, folder))
    assert len(left) == 2 and left[1] == names[9]
    merged = left[0]
    assert merged.endswith("-L2.arrow") and merged[:24] == names[0][:24]  # "seg-" + the 20-digit time
    assert _segment_rows(layout, folder, merged) == 9 * 20
    fresh = ScoreCache(layout.fs, folder, compact_at=0)
    for b in range(10):
        assert fresh.get_many(keys_of(0, b)) == {k: value_for(k) for k in keys_of(0, b)}, b


def test_compaction_keeps_each_key_once(cache_dir):
    """Three puts of the same 20 keys (three workers scoring the same pairs) merge into 20 rows, not 60."""
    layout, folder = cache_dir
    cache = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=3)
    for _ in range(3):
        cache.put_many({k: value_for(k) for k in keys_of(0, 0)})
    (only,) = list_files(layout.fs, folder)
    assert only.endswith("-L1.arrow") and _segment_rows(layout, folder, only) == 20


def test_a_warm_reader_follows_segments_merged_away_under_it(cache_dir):
    """A reader that read level-0 segments before another writer merged them: its next refresh forgets
    the deleted segments, reads the merged one, and still answers every key, holding each once."""
    layout, folder = cache_dir
    writer = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=3)
    reader = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=0)
    for b in range(2):
        writer.put_many({k: value_for(k) for k in keys_of(0, b)})
    assert len(reader.get_many(keys_of(0, 0) + keys_of(0, 1))) == 40
    writer.put_many({k: value_for(k) for k in keys_of(0, 2)})  # the third put merges all three
    assert len(list_files(layout.fs, folder)) == 1
    every = keys_of(0, 0) + keys_of(0, 1) + keys_of(0, 2)
    assert reader.get_many(every) == {k: value_for(k) for k in every}
    assert len(reader) == 60


def test_a_merge_repeated_by_a_second_writer_leaves_one_segment(cache_dir, monkeypatch):
    """Writer A merges three segments and dies before deleting them; writer B merges the same three: the
    folder then holds ONE merged segment (the same name), with every entry, and no input."""
    import storage.score_cache as score_cache_module

    layout, folder = cache_dir
    a = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=0)  # fills level 0 without merging
    inputs = [a.put_many({k: value_for(k) for k in keys_of(0, b)}) for b in range(3)]
    with monkeypatch.context() as m:
        m.setattr(score_cache_module.fsutil, "remove_files", lambda fs, paths: None)  # "dies" before its deletes
        merged_by_a = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=3).compact()
    assert len(list_files(layout.fs, folder)) == 4  # three inputs still there beside A's merge
    merged_by_b = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=3).compact()
    assert merged_by_a == merged_by_b and set(list_files(layout.fs, folder)) == set(merged_by_b)
    assert _segment_rows(layout, folder, merged_by_b[0]) == 60
    assert not set(inputs) & set(list_files(layout.fs, folder))


def test_a_merge_whose_input_is_gone_writes_and_deletes_nothing(cache_dir):
    """Another writer took one input first: this writer stops compacting, leaving the folder as it was."""
    layout, folder = cache_dir
    a = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=0)
    names = [a.put_many({k: value_for(k) for k in keys_of(0, b)}) for b in range(3)]
    b = ScoreCache(layout.fs, folder, max_bytes=0, compact_at=3)
    sizes = b._segment_sizes()  # b lists all three ...
    remove_files(layout.fs, [f"{folder}/{names[1]}"])  # ... then another writer takes one
    assert b._compact(sizes) == []
    assert set(list_files(layout.fs, folder)) == {names[0], names[2]}


def test_remove_files_removes_exactly_those_listed_and_ignores_gone_ones(cache_dir):
    """The cache's deletes (merge inputs, evictions): one call for many files; a file another writer
    removed first is no error; files not named stay."""
    layout, folder = cache_dir
    for name in ("a", "b", "c"):
        write_bytes_atomic(layout.fs, f"{folder}/{name}", name.encode())
    remove_files(layout.fs, [f"{folder}/a", f"{folder}/b", f"{folder}/gone-already"])
    assert list_files(layout.fs, folder) == {"c": 1}
    remove_files(layout.fs, [])


def test_compact_at_one_is_refused(cache_dir):
    layout, folder = cache_dir
    with pytest.raises(ValueError, match="compact_at=1"):
        ScoreCache(layout.fs, folder, compact_at=1)


def _writer_job(root_url, cfg_json, folder_rel, writer, batches, errors, compact_at=0):
    """One writer: puts `batches` segments and, between puts, reads everything written so far."""
    from ppoflow.config import StorageConfig

    try:
        fs, root = resolve(root_url, StorageConfig.model_validate_json(cfg_json))
        cache = ScoreCache(fs, f"{root}/{folder_rel}", max_bytes=0, compact_at=compact_at)
        for batch in range(batches):
            cache.put_many({k: value_for(k) for k in keys_of(writer, batch)})
            cache.refresh()
            for key, value in cache.items():
                if value != value_for(key):
                    errors.append(f"writer {writer}: torn entry {key}")
    except Exception as e:  # reported to the test, which fails on any
        errors.append(f"writer {writer}: {type(e).__name__}: {e}")


def _check_all_present(layout, folder, writers, batches, compacted=False):
    reader = ScoreCache(layout.fs, folder, compact_at=0)
    for w in range(writers):
        for b in range(batches):
            keys = keys_of(w, b)
            got = reader.get_many(keys)
            assert got == {k: value_for(k) for k in keys}, (w, b)
    if not compacted:
        assert len(list_files(layout.fs, folder)) == writers * batches  # one segment per put, none overwritten


def _folder_rel(layout, folder):
    return folder[len(layout.root) :].lstrip("/")


@pytest.mark.parametrize("compact_at", [0, 3], ids=["no-compaction", "compacting"])
def test_concurrent_writer_threads(cache_dir, compact_at):
    """Four writers at once; with compact_at=3 they also merge and delete each other's segments while the
    others read them: no entry may be lost or torn either way."""
    layout, folder = cache_dir
    errors: list[str] = []
    cfg_json = layout.storage_cfg.model_dump_json()
    threads = [
        threading.Thread(
            target=_writer_job, args=(layout.root_url, cfg_json, _folder_rel(layout, folder), w, 4, errors, compact_at)
        )
        for w in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    _check_all_present(layout, folder, writers=4, batches=4, compacted=bool(compact_at))
    # 16 puts merged by threes reach level 2 (9 <= 16 < 27) when merges never repeat; racing writers may
    # merge overlapping inputs once in a while, never a level further per race. Writers that each wrote
    # their own copy of a merge multiplied without end (levels past 20).
    levels = [_segment_level(name) for name in list_files(layout.fs, folder)]
    assert max(levels) <= 3 and len(levels) <= 16, sorted(levels)


def _process_entry(root_url, cfg_json, folder_rel, writer, batches, queue):
    errors: list[str] = []
    _writer_job(root_url, cfg_json, folder_rel, writer, batches, errors)
    queue.put(errors)


@pytest.mark.slow
def test_concurrent_writer_processes(cache_dir):
    layout, folder = cache_dir
    ctx = multiprocessing.get_context("spawn")  # no s3fs event loop or lock inherited through fork
    queue = ctx.Queue()
    args = (layout.root_url, layout.storage_cfg.model_dump_json(), _folder_rel(layout, folder))
    procs = [ctx.Process(target=_process_entry, args=(*args, w, 3, queue)) for w in range(2)]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert reports == [[], []]
    _check_all_present(layout, folder, writers=2, batches=3)
