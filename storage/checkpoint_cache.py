"""The local cache of remote checkpoints: where `load_checkpoint` copies a checkpoint from object storage,
and the eviction that keeps only the most recently used copies."""

from __future__ import annotations

import logging
import os
import re
import shutil
import time

from storage.fs import local_cache_root
from storage.layout import RunLayout

log = logging.getLogger(__name__)


def checkpoint_cache_dir(layout: RunLayout) -> str:
    """The local folder holding this run's copies of remote checkpoints, one subfolder per commit marker:
    storage.local_cache_dir, else $PPOFLOW_CACHE, else ~/.cache/ppoflow; then checkpoints/<run name>."""
    return os.path.join(local_cache_root(layout.storage_cfg.local_cache_dir), "checkpoints", layout.run_name)


_COPY_NAME = re.compile(r"[0-9a-f]{16}")  # a cached copy's folder: the marker digest of load_checkpoint


def evict_cached_copies(current: str, keep: int) -> list[str]:
    """Mark the cached copy `current` as just used, then delete all but the `keep` most recently used
    copies beside it. Returns the folders removed.

    Without this the cache grew by one checkpoint per iteration for as long as the run lasted: a worker
    that is not the trainer (a rollout pool, a resumed run on a new machine) fetches every new policy.
    Recency is the folder's mtime, set here with an explicit nanosecond time (the kernel's own file
    times move in timer ticks). A process on this machine still reading a copy loses it only once `keep`
    newer copies have been loaded since it began, so keep >= 2 covers a worker that reads the checkpoint
    the trainer just wrote while the trainer goes on to the next.
    """
    now = time.time_ns()
    os.utime(current, ns=(now, now))
    parent = os.path.dirname(current)
    copies = []
    with os.scandir(parent) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and _COPY_NAME.fullmatch(entry.name):
                copies.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path))
    removed = []
    for _, path in sorted(copies, reverse=True)[keep:]:
        if path != current:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("checkpoint cache %s: removed %d older copies (keeping %d)", parent, len(removed), keep)
    return removed
