"""Checkpoints: staged upload, a commit marker written last, the LATEST pointer, retention.

    <run>/checkpoints/iter-000003/policy/...     Hugging Face folder (from_pretrained / vLLM)
    <run>/checkpoints/iter-000003/critic/...
    <run>/checkpoints/iter-000003/trainer/...    optimizer, scheduler, KL controller, RNG, data cursor
    <run>/checkpoints/iter-000003/_STAGED.json   {files: {relative path: {bytes, sha256}}}: staging done
    <run>/checkpoints/iter-000003/_COMMITTED     JSON {iteration, files, meta, committed_at}: THE commit
    <run>/LATEST                                 JSON {"iteration": 3, "uri": ...}: a verified hint

Protocol: `save_checkpoint_files` (update stage) clears the iteration's uncommitted folder, uploads each
file atomically, then writes _STAGED.json. `commit_checkpoint` (checkpoint stage, possibly on another
machine) checks the staged files are all there, writes _COMMITTED, then LATEST, then applies retention.
A crash before _COMMITTED leaves the previous checkpoint as the latest; a crash after it but before
LATEST is repaired by `latest_iteration` (it trusts markers, not LATEST) and by a retried commit,
which is idempotent. A committed checkpoint is never written into or overwritten. On a local disk every
write is durable when it returns (storage/fs.py fsyncs file and folder), so the order above also holds
after a machine crash: files before the marker, the marker before retention deletes an older checkpoint.

A forked run's checkpoints up to its fork point are references to its parent's (`_REFERENCE.json` instead of
files, storage/lineage.py): they read as committed with the parent's marker and load from the parent's folder;
retention removes only the reference, and never removes a checkpoint that a fork pinned in `<run>/_forks/`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
from typing import Any, Callable, Iterable, Optional, Sequence

from storage import fs as fsutil
from storage import lineage
from storage.checkpoint_cache import checkpoint_cache_dir, evict_cached_copies
from storage.layout import RunLayout, parse_iteration_name

log = logging.getLogger(__name__)

STAGED_NAME = "_STAGED.json"
MARKER_NAME = "_COMMITTED"
_HASH_CHUNK = 8 * 2**20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be staged, committed or loaded as asked; the message names the iteration."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint's file is missing or differs from its marker; the message names the file."""


def file_sha256(local_path: str) -> str:
    h = hashlib.sha256()
    with open(local_path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _local_files(local_dir: str) -> dict[str, str]:
    """{relative path with "/": absolute path} of every file under `local_dir`, sorted."""
    found = {}
    for folder, _dirs, names in os.walk(local_dir):
        for name in names:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, local_dir).replace(os.sep, "/")] = path
    return dict(sorted(found.items()))


def _own_marker(layout: RunLayout, iteration: int) -> Optional[dict[str, Any]]:
    try:
        marker = fsutil.read_json(layout.fs, fsutil.join(layout.checkpoint_dir(iteration), MARKER_NAME))
    except ValueError:
        return None  # a marker is written in one PUT, so unreadable means damaged: not a usable commit
    if not isinstance(marker, dict) or marker.get("iteration") != iteration or "files" not in marker:
        return None
    return marker


def checkpoint_owner(layout: RunLayout, iteration: int) -> RunLayout:
    """The run whose folder holds the files of `layout`'s checkpoint `iteration`: `layout` itself, or, for a
    fork's checkpoint at or before its fork point, the run its reference names (storage/lineage.py)."""
    if fsutil.exists(layout.fs, fsutil.join(layout.checkpoint_dir(iteration), MARKER_NAME)):
        return layout
    reference = lineage.read_reference(layout, iteration)
    return layout if reference is None else lineage.referenced_layout(layout, reference)


def read_commit_marker(layout: RunLayout, iteration: int) -> Optional[dict[str, Any]]:
    """The _COMMITTED marker of `iteration`, or None when it is not committed (or the marker is unreadable).

    A fork's referenced checkpoint reads as its owner's marker: None once the owner no longer holds it."""
    marker = _own_marker(layout, iteration)
    if marker is not None:
        return marker
    owner = checkpoint_owner(layout, iteration)
    return None if owner is layout else _own_marker(owner, iteration)


def is_committed(layout: RunLayout, iteration: int) -> bool:
    return read_commit_marker(layout, iteration) is not None


def save_checkpoint_files(
    layout: RunLayout, iteration: int, local_dir: str, move: bool = False, known_sha256: Optional[dict[str, str]] = None
) -> dict[str, Any]:
    """Upload `local_dir` (policy/, critic/, trainer/, ...) as iteration `iteration`'s staged checkpoint.

    move: the files of `local_dir` are scratch the caller gives up; on local storage they are renamed into
    place instead of copied (see storage.fs.move_file_atomic).
    known_sha256: {relative path: sha256} the caller computed from the bytes as it wrote them; those files
    are not read back to hash them (the others are). A wrong entry is caught when the checkpoint is loaded
    (CheckpointCorruptError names the file).

    Returns {"iteration", "files": {relative path: {"bytes", "sha256"}}} (JSON-able). A retry first
    removes the iteration's earlier, uncommitted upload. Raises CheckpointError when the iteration is
    already committed (never overwritten) or `local_dir` holds no files.
    """
    target = layout.checkpoint_dir(iteration)
    if is_committed(layout, iteration):
        raise CheckpointError(f"checkpoint {layout.url(target)} is already committed; refusing to overwrite it")
    local_files = _local_files(local_dir)
    if not local_files:
        raise CheckpointError(f"nothing to save for iteration {iteration}: {local_dir} holds no files")
    reserved = {STAGED_NAME, MARKER_NAME} & set(local_files)
    if reserved:
        raise CheckpointError(f"{local_dir} contains reserved checkpoint file names {sorted(reserved)}")
    fsutil.remove_tree(layout.fs, target)
    known = known_sha256 or {}
    files = {}
    for rel, path in local_files.items():
        files[rel] = {"bytes": os.path.getsize(path), "sha256": known.get(rel) or file_sha256(path)}
        (fsutil.move_file_atomic if move else fsutil.upload_file_atomic)(layout.fs, path, fsutil.join(target, rel))
    staged = {"iteration": iteration, "files": files}
    fsutil.write_json(layout.fs, fsutil.join(target, STAGED_NAME), staged)
    return staged


def commit_checkpoint(
    layout: RunLayout,
    iteration: int,
    meta: Optional[dict[str, Any]] = None,
    keep_last: int = 2,
    verify_staged: Optional[Callable[[dict[str, Any]], None]] = None,
) -> dict[str, Any]:
    """Commit the staged checkpoint of `iteration`: marker, then LATEST, then retention. Idempotent.

    verify_staged: called with the staged {relative path: {"bytes", "sha256"}} before the marker is written (not
    when the iteration is committed already); whatever it raises refuses the commit, and nothing is written.

    Returns the marker. Raises CheckpointError when nothing is staged or a staged file is missing or
    has another size than staged (the error names the file).
    """
    target = layout.checkpoint_dir(iteration)
    marker = read_commit_marker(layout, iteration)
    if marker is None:
        marker = _write_marker(layout, iteration, meta or {}, verify_staged)
    latest = latest_iteration(layout)
    if latest is None or latest <= iteration:
        fsutil.write_json(
            layout.fs,
            layout.latest_path,
            {"iteration": iteration, "uri": layout.url(target), "committed_at": marker["committed_at"]},
        )
    apply_retention(layout, keep_last)
    return marker


def _write_marker(
    layout: RunLayout, iteration: int, meta: dict[str, Any], verify_staged: Optional[Callable] = None
) -> dict[str, Any]:
    target = layout.checkpoint_dir(iteration)
    try:
        staged = fsutil.read_json(layout.fs, fsutil.join(target, STAGED_NAME))
    except ValueError as e:
        raise CheckpointError(f"cannot commit iteration {iteration}: {e}") from None
    if not staged or not staged.get("files"):
        raise CheckpointError(
            f"cannot commit iteration {iteration}: nothing staged at {layout.url(target)} "
            f"(no {STAGED_NAME}; did the update stage finish?)"
        )
    if verify_staged is not None:
        verify_staged(staged["files"])
    present = fsutil.list_files(layout.fs, target)
    for rel, info in staged["files"].items():
        if present.get(rel) != info["bytes"]:
            found = "missing" if rel not in present else f"{present[rel]} bytes"
            raise CheckpointError(
                f"cannot commit iteration {iteration}: staged file "
                f"{layout.url(fsutil.join(target, rel))} is {found}, expected {info['bytes']} bytes"
            )
    marker = {
        "iteration": iteration,
        "files": staged["files"],
        "meta": meta,
        "committed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    fsutil.write_json(layout.fs, fsutil.join(target, MARKER_NAME), marker)
    return marker


def checkpoint_iterations(layout: RunLayout) -> dict[int, bool]:
    """{iteration: committed?} for every iter-* folder under checkpoints/."""
    fs = layout.fs
    fs.invalidate_cache(layout.checkpoints_dir)
    try:
        names = fs.ls(layout.checkpoints_dir, detail=False)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        number = parse_iteration_name(name)
        if number is not None:
            found[number] = is_committed(layout, number)
    return dict(sorted(found.items()))


def latest_iteration(layout: RunLayout) -> Optional[int]:
    """The newest committed iteration, or None when nothing is committed.

    The commit markers are the truth; LATEST is a pointer that saves a listing. LATEST is used when
    its iteration has a valid marker and the next iteration has none; otherwise (LATEST missing,
    corrupt, pointing at an uncommitted checkpoint, or a crash between a marker and LATEST) the
    checkpoints folder is listed and the newest committed marker wins.
    """
    try:
        pointer = fsutil.read_json(layout.fs, layout.latest_path)
    except ValueError:
        pointer = None
    candidate = pointer.get("iteration") if isinstance(pointer, dict) else None
    if isinstance(candidate, int) and is_committed(layout, candidate) and not is_committed(layout, candidate + 1):
        return candidate
    committed = [i for i, ok in checkpoint_iterations(layout).items() if ok]
    return max(committed) if committed else None


def holds_optimizer_state(marker: dict[str, Any]) -> bool:
    """Whether a committed checkpoint (its marker) holds the actor's optimizer state: with
    train.optimizer_state_every = N > 1 only every N-th and the run's last do (engines/trainer/checkpoint.py)."""
    return any(rel.startswith("trainer/actor_optimizer.") for rel in marker["files"])


def newest_with_optimizer_state(layout: RunLayout, iterations: Iterable[int]) -> Optional[int]:
    """The newest of `iterations` whose checkpoint of `layout` is committed (a fork's referenced ones included) and
    holds the optimizer state; None when none does."""
    for number in sorted(iterations, reverse=True):
        marker = read_commit_marker(layout, number)
        if marker is not None and holds_optimizer_state(marker):
            return number
    return None


def apply_retention(layout: RunLayout, keep_last: int) -> list[int]:
    """Remove committed checkpoints older than the newest `keep_last`, and stale uncommitted folders.

    Never removes the latest committed checkpoint, nor an uncommitted folder newer than it (an update
    may be staging it right now), nor the newest one that holds the optimizer state (a resume at a newer one
    without it starts from there: stages/update_replay.py). A removal deletes the marker first, so a crash
    mid-way leaves an uncommitted folder (removed next time), never a committed one with files missing.
    Returns the iterations removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the latest checkpoint is always kept), got {keep_last}")
    state = checkpoint_iterations(layout)
    committed = sorted((i for i, ok in state.items() if ok), reverse=True)
    if not committed:
        return []
    pinned = lineage.pinned_iterations(layout)
    if pinned is None:
        log.warning("retention of %s skipped: a record under %s/ is unreadable", layout.run_name, lineage.FORKS_DIR)
        return []
    latest, kept = committed[0], set(committed[:keep_last]) | pinned
    if (base := newest_with_optimizer_state(layout, committed)) is not None:
        kept.add(base)
    removed = []
    for number, ok in state.items():
        if number in kept or (not ok and number > latest):
            continue
        _remove_checkpoint(layout, number, ok)
        removed.append(number)
    return removed


def _remove_checkpoint(layout: RunLayout, iteration: int, committed: bool) -> None:
    """Remove a checkpoint folder, its commit first. A fork's reference folder loses its reference, then the
    owner's pin goes (storage/lineage.py): never the owner's files."""
    folder = layout.checkpoint_dir(iteration)
    reference = lineage.read_reference(layout, iteration)
    if committed and fsutil.exists(layout.fs, fsutil.join(folder, MARKER_NAME)):
        layout.fs.rm_file(fsutil.join(folder, MARKER_NAME))
    elif reference is not None:
        layout.fs.rm_file(lineage.reference_path(layout, iteration))
    fsutil.remove_tree(layout.fs, folder)
    if reference is not None:
        lineage.unpin(lineage.referenced_layout(layout, reference), layout.run_name, iteration)


def load_checkpoint(
    layout: RunLayout,
    iteration: int,
    local_cache_dir: Optional[str] = None,
    verify: bool = True,
    parts: Optional[Sequence[str]] = None,
) -> str:
    """A local folder holding committed checkpoint `iteration` (policy/, critic/, trainer/).

    Remote checkpoints are copied under `local_cache_dir` (default: `checkpoint_cache_dir(layout)`), which
    then keeps only the storage.checkpoint_cache_keep most recently used copies; local ones are used in place.
    With `verify`, every file is checked against the marker's size and sha256. `parts` (e.g. ("policy",)):
    only those top-level folders are copied and verified, so a rollout worker does not download and hash the
    optimizer state it never reads (two thirds of the bytes with AdamW); other folders of the returned path
    may then be absent or unverified.
    Raises CheckpointError when not committed or a part is not in it, CheckpointCorruptError naming the file.
    """
    marker = read_commit_marker(layout, iteration)
    if marker is None:
        source = layout.checkpoint_dir(iteration)
        raise CheckpointError(f"checkpoint {layout.url(source)} is not committed (no valid {MARKER_NAME})")
    layout = checkpoint_owner(layout, iteration)  # a fork's checkpoint at or before its fork point: the parent's
    source = layout.checkpoint_dir(iteration)
    files = marker["files"]
    if parts is not None:
        present = sorted({rel.split("/", 1)[0] for rel in files if "/" in rel})
        for part in parts:
            if part not in present:
                raise CheckpointError(f"checkpoint {layout.url(source)} has no {part}/ folder (it holds {present})")
        files = {rel: info for rel, info in files.items() if rel.split("/", 1)[0] in parts}
    cache_root = None
    if not fsutil.is_local(layout.fs):
        # Keyed by the marker's content too: a path reused by a newer commit (a bucket recreated, a run
        # restarted from scratch) must not be served from an older cached copy.
        marker_digest = hashlib.sha256(json.dumps(marker, sort_keys=True).encode()).hexdigest()[:16]
        cache_root = os.path.join(local_cache_dir or checkpoint_cache_dir(layout), marker_digest)
    local = fsutil.materialize(layout.fs, source, cache_root, parts)
    if verify:
        try:
            _verify_files(local, files, layout.url(source))
        except CheckpointCorruptError:
            if local != source:
                fsutil.remove_tree(fsutil.resolve(local)[0], local)  # never reuse a bad cached copy
            raise
    if cache_root is not None:
        evict_cached_copies(cache_root, layout.storage_cfg.checkpoint_cache_keep)
    return local


def _verify_files(local_dir: str, files: dict[str, dict[str, Any]], source_url: str) -> None:
    for rel, info in files.items():
        path = os.path.join(local_dir, *rel.split("/"))
        where = f"{source_url}/{rel}"
        if not os.path.isfile(path):
            raise CheckpointCorruptError(f"checkpoint file {where} is missing")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise CheckpointCorruptError(f"checkpoint file {where} has {size} bytes, marker says {info['bytes']}")
        if file_sha256(path) != info["sha256"]:
            raise CheckpointCorruptError(
                f"checkpoint file {where} fails its sha256 check; `ppoflow runs repair RUN` "
                f"quarantines the checkpoint so the next start recomputes it"
            )
