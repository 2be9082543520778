"""Checkpoints (staging, commit marker, LATEST, retention) on a local folder and on the moto S3 server."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

import storage.checkpoints as ckpt
from storage.checkpoint_cache import checkpoint_cache_dir
from storage.fs import is_local, list_files, write_bytes_atomic, write_json
from storage.layout import RunLayout


@pytest.fixture
def layout(storage_root):
    root, cfg = storage_root
    return RunLayout(root, "run-c", cfg)


def make_local_checkpoint(folder, iteration: int) -> dict[str, bytes]:
    """policy/, critic/, trainer/ files whose bytes depend on the iteration; returns {relative path: bytes}."""
    files = {
        "policy/model.safetensors": bytes([iteration % 256]) * 4096,
        "policy/config.json": json.dumps({"iteration": iteration}).encode(),
        "critic/model.safetensors": bytes([(iteration + 7) % 256]) * 2048,
        "trainer/state.json": json.dumps({"data_cursor": iteration + 1}).encode(),
    }
    for rel, data in files.items():
        path = os.path.join(folder, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return files


def save_and_commit(layout, tmp_path, iteration: int, keep_last: int = 2) -> dict[str, bytes]:
    local = tmp_path / f"local-{iteration}"
    files = make_local_checkpoint(local, iteration)
    ckpt.save_checkpoint_files(layout, iteration, str(local))
    ckpt.commit_checkpoint(layout, iteration, {"note": f"iteration {iteration}"}, keep_last=keep_last)
    return files


def assert_loads_as(layout, iteration, files, cache_dir):
    folder = ckpt.load_checkpoint(layout, iteration, str(cache_dir))
    for rel, data in files.items():
        with open(os.path.join(folder, *rel.split("/")), "rb") as f:
            assert f.read() == data, rel


def test_save_commit_load_round_trip(layout, tmp_path):
    assert ckpt.latest_iteration(layout) is None
    files = save_and_commit(layout, tmp_path, 1)
    marker = ckpt.read_commit_marker(layout, 1)
    # The marker lists every file with its size and sha256, computed here independently.
    assert marker["files"] == {
        rel: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()
    }
    assert marker["meta"] == {"note": "iteration 1"}
    assert json.loads(layout.fs.cat_file(layout.latest_path))["iteration"] == 1
    assert ckpt.latest_iteration(layout) == 1 and ckpt.is_committed(layout, 1)
    assert_loads_as(layout, 1, files, tmp_path / "cache")


def test_committed_checkpoint_is_never_overwritten(layout, tmp_path):
    save_and_commit(layout, tmp_path, 1)
    with pytest.raises(ckpt.CheckpointError, match="already committed"):
        ckpt.save_checkpoint_files(layout, 1, str(tmp_path / "local-1"))
    marker = ckpt.read_commit_marker(layout, 1)
    assert ckpt.commit_checkpoint(layout, 1, {"other": True}) == marker  # idempotent, meta unchanged


def test_crash_between_files_and_marker_keeps_previous_checkpoint(layout, tmp_path, monkeypatch):
    first = save_and_commit(layout, tmp_path, 1)
    make_local_checkpoint(tmp_path / "local-2", 2)

    real_write_json = ckpt.fsutil.write_json

    def crash_on_marker(fs, path, obj):
        if path.endswith("/_COMMITTED"):
            raise KeyboardInterrupt("injected crash before the commit marker")
        real_write_json(fs, path, obj)

    ckpt.save_checkpoint_files(layout, 2, str(tmp_path / "local-2"))
    monkeypatch.setattr(ckpt.fsutil, "write_json", crash_on_marker)
    with pytest.raises(KeyboardInterrupt):
        ckpt.commit_checkpoint(layout, 2, {})
    monkeypatch.undo()

    assert "policy/model.safetensors" in list_files(layout.fs, layout.checkpoint_dir(2))  # staged files exist
    assert not ckpt.is_committed(layout, 2) and ckpt.latest_iteration(layout) == 1
    assert_loads_as(layout, 1, first, tmp_path / "cache")
    with pytest.raises(ckpt.CheckpointError, match="not committed"):
        ckpt.load_checkpoint(layout, 2, str(tmp_path / "cache"))

    # A retried update re-stages iteration 2 from scratch; the retried commit then succeeds.
    second = save_and_commit(layout, tmp_path, 2)
    assert ckpt.latest_iteration(layout) == 2
    assert_loads_as(layout, 2, second, tmp_path / "cache")


def test_latest_falls_back_to_markers(layout, tmp_path):
    save_and_commit(layout, tmp_path, 1)
    save_and_commit(layout, tmp_path, 2)
    write_bytes_atomic(layout.fs, layout.latest_path, b"{not json")
    assert ckpt.latest_iteration(layout) == 2
    layout.fs.rm_file(layout.latest_path)
    assert ckpt.latest_iteration(layout) == 2
    # A crash between iteration 2's marker and LATEST: LATEST still says 1, the marker of 2 wins.
    write_json(layout.fs, layout.latest_path, {"iteration": 1})
    assert ckpt.latest_iteration(layout) == 2


def test_retention_keeps_last_k_and_the_latest(layout, tmp_path):
    for i in (1, 2, 3, 4):
        save_and_commit(layout, tmp_path, i, keep_last=2)
    make_local_checkpoint(tmp_path / "local-5", 5)
    ckpt.save_checkpoint_files(layout, 5, str(tmp_path / "local-5"))  # in flight: staged, not committed
    assert ckpt.checkpoint_iterations(layout) == {3: True, 4: True, 5: False}
    # keep_last=1 keeps only 4 (the latest); 3 goes; uncommitted 5 is newer than the latest and stays.
    assert ckpt.apply_retention(layout, keep_last=1) == [3]
    assert ckpt.checkpoint_iterations(layout) == {4: True, 5: False}


def test_corrupt_checkpoint_file_is_named(layout, tmp_path):
    save_and_commit(layout, tmp_path, 1)
    victim = f"{layout.checkpoint_dir(1)}/critic/model.safetensors"
    write_bytes_atomic(layout.fs, victim, b"\x00" * 2048)  # same size, other bytes
    with pytest.raises(ckpt.CheckpointCorruptError, match="critic/model.safetensors fails its sha256"):
        ckpt.load_checkpoint(layout, 1, str(tmp_path / "cache"))


def read_local(folder, rel) -> bytes:
    with open(os.path.join(folder, *rel.split("/")), "rb") as f:
        return f.read()


def test_a_policy_only_load_fetches_and_verifies_only_the_policy(layout, tmp_path):
    """A rollout worker needs policy/: it must neither download nor hash the trainer state."""
    files = save_and_commit(layout, tmp_path, 1)
    bad = b"x" * len(files["trainer/state.json"])  # same size, other bytes: only a hash can tell
    write_bytes_atomic(layout.fs, f"{layout.checkpoint_dir(1)}/trainer/state.json", bad)
    folder = ckpt.load_checkpoint(layout, 1, str(tmp_path / "cache"), parts=("policy",))
    for rel in ("policy/model.safetensors", "policy/config.json"):
        assert read_local(folder, rel) == files[rel], rel
    if not is_local(layout.fs):  # remote: nothing but policy/ was copied
        assert sorted(os.listdir(folder)) == ["policy"]
    # the whole checkpoint is still checked in full, from the same cache
    with pytest.raises(ckpt.CheckpointCorruptError, match="trainer/state.json fails its sha256"):
        ckpt.load_checkpoint(layout, 1, str(tmp_path / "cache"))


def test_a_policy_only_load_still_checks_the_policy_and_names_a_missing_part(layout, tmp_path):
    files = save_and_commit(layout, tmp_path, 1)
    bad = b"\x02" * len(files["policy/model.safetensors"])  # iteration 1 wrote 0x01 bytes
    write_bytes_atomic(layout.fs, f"{layout.checkpoint_dir(1)}/policy/model.safetensors", bad)
    with pytest.raises(ckpt.CheckpointCorruptError, match="policy/model.safetensors fails its sha256"):
        ckpt.load_checkpoint(layout, 1, str(tmp_path / "cache"), parts=("policy",))
    with pytest.raises(
        ckpt.CheckpointError, match=r"has no actor/ folder \(it holds \['critic', 'policy', 'trainer'\]\)"
    ):
        ckpt.load_checkpoint(layout, 1, str(tmp_path / "cache"), parts=("actor",))


def test_known_hashes_are_used_as_given_and_a_wrong_one_is_caught_on_load(layout, tmp_path):
    local = tmp_path / "local-1"
    files = make_local_checkpoint(local, 1)
    right = hashlib.sha256(files["policy/model.safetensors"]).hexdigest()
    staged = ckpt.save_checkpoint_files(
        layout, 1, str(local), known_sha256={"policy/model.safetensors": right, "critic/model.safetensors": "0" * 64}
    )
    assert staged["files"]["policy/model.safetensors"]["sha256"] == right
    assert staged["files"]["critic/model.safetensors"]["sha256"] == "0" * 64  # taken as given, not re-read
    assert staged["files"]["trainer/state.json"]["sha256"] == hashlib.sha256(files["trainer/state.json"]).hexdigest()
    ckpt.commit_checkpoint(layout, 1)
    with pytest.raises(ckpt.CheckpointCorruptError, match="critic/model.safetensors fails its sha256"):
        ckpt.load_checkpoint(layout, 1, str(tmp_path / "cache"))


def test_commit_without_staging_is_an_error(layout, tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="nothing staged"):
        ckpt.commit_checkpoint(layout, 3, {})
    make_local_checkpoint(tmp_path / "local-3", 3)
    ckpt.save_checkpoint_files(layout, 3, str(tmp_path / "local-3"))
    layout.fs.rm_file(f"{layout.checkpoint_dir(3)}/trainer/state.json")
    with pytest.raises(ckpt.CheckpointError, match="trainer/state.json is missing"):
        ckpt.commit_checkpoint(layout, 3, {})


@pytest.mark.slow
def test_policy_folder_loads_with_from_pretrained(layout, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    local = tmp_path / "local-1"
    shutil.copytree(tiny_model_dir, local / "policy")
    ckpt.save_checkpoint_files(layout, 1, str(local))
    ckpt.commit_checkpoint(layout, 1, {})
    folder = ckpt.load_checkpoint(layout, 1, str(tmp_path / "cache"))
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "policy"))
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items()):
        assert a.equal(b), name


def test_local_checkpoint_files_are_durable_before_the_marker_and_the_marker_before_retention(
    layout, tmp_path, monkeypatch
):
    if not is_local(layout.fs):
        pytest.skip("fsync order is a local-disk matter: an S3 object is durable when its PUT returns")
    save_and_commit(layout, tmp_path, 1, keep_last=1)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("replace", os.path.abspath(dst)))

    def rmtree(path, *args, **kwargs):
        events.append(("rmtree", os.path.abspath(path)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    files = save_and_commit(layout, tmp_path, 2, keep_last=1)
    target = os.path.abspath(layout.checkpoint_dir(2))
    marker_at = events.index(("replace", os.path.join(target, ckpt.MARKER_NAME)))
    for rel in files:
        final = os.path.join(target, *rel.split("/"))
        placed = events.index(("replace", final))
        folder = os.path.dirname(final)
        # the data was flushed under its temporary name before the rename, the folder entry after it,
        # and both before the marker
        data_synced = [
            i
            for i, (kind, path) in enumerate(events[:placed])
            if kind == "fsync"
            and os.path.dirname(path) == folder
            and os.path.basename(path).startswith(f".{os.path.basename(final)}.tmp-")
        ]
        assert data_synced, rel
        assert ("fsync", folder) in events[placed:marker_at], rel
    # the new iteration folder's own entry in checkpoints/ is durable before the marker too
    assert ("fsync", os.path.dirname(target)) in events[:marker_at]
    # retention removes iteration 1 only after the marker's folder entry is on disk
    removed = events.index(("rmtree", os.path.abspath(layout.checkpoint_dir(1))))
    assert ("fsync", target) in events[marker_at:removed]


def _cached_iterations(cache_dir) -> set[int]:
    """Iterations with a copy in the cache: <cache>/<marker digest>/<url hash>/iter-NNNNNN/."""
    return {int(p.name.split("-")[1]) for p in cache_dir.glob("*/*/iter-*")}


def test_cached_copies_of_remote_checkpoints_are_bounded_most_recently_used_first(s3_bucket, tmp_path):
    bucket, cfg = s3_bucket
    layout = RunLayout(f"s3://{bucket}/runs", "run-cache", cfg.model_copy(update={"checkpoint_cache_keep": 2}))
    files = {i: save_and_commit(layout, tmp_path, i, keep_last=4) for i in (1, 2, 3, 4)}
    cache = tmp_path / "cache"
    # Loads in this order, and the copies a 2-entry least-recently-used cache holds after each (by hand).
    expected_after = [(1, {1}), (2, {1, 2}), (1, {1, 2}), (3, {1, 3}), (4, {3, 4}), (1, {4, 1})]
    for iteration, expected in expected_after:
        assert_loads_as(layout, iteration, files[iteration], cache)  # evicted copies come back intact
        assert _cached_iterations(cache) == expected, (iteration, expected)


def test_checkpoint_cache_folder_is_the_configured_one_else_ppoflow_cache(s3_bucket, tmp_path, monkeypatch):
    bucket, cfg = s3_bucket
    monkeypatch.setenv("PPOFLOW_CACHE", str(tmp_path / "env-cache"))
    by_env = RunLayout(f"s3://{bucket}/runs", "run-e", cfg)
    assert checkpoint_cache_dir(by_env) == str(tmp_path / "env-cache" / "checkpoints" / "run-e")
    save_and_commit(by_env, tmp_path, 1)
    assert ckpt.load_checkpoint(by_env, 1).startswith(str(tmp_path / "env-cache" / "checkpoints" / "run-e") + os.sep)
    configured = RunLayout(
        f"s3://{bucket}/runs", "run-e", cfg.model_copy(update={"local_cache_dir": str(tmp_path / "mine")})
    )
    assert checkpoint_cache_dir(configured) == str(tmp_path / "mine" / "checkpoints" / "run-e")
