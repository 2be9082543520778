"""Repairing a run whose latest committed checkpoint is corrupt: quarantine it, so the next start recomputes it.

Every input of iteration N (the previous checkpoint, the shards, the seeds) is still committed, and an
iteration's result depends on nothing else, so recomputing N from N-1 gives the same bytes as the lost
checkpoint (a test proves it). Nothing is deleted: the checkpoint moves to `<run>/quarantine/iter-N-<UTC>/`
for a person to look at, and its metrics row is left to be replaced when N is recomputed.

    check_latest(layout)       (N, None) when checkpoint N verifies, (N, the error) when it does not
    quarantine(layout, N)      move checkpoint N out of checkpoints/; returns where it went
"""

from __future__ import annotations

import datetime as _dt
from typing import Optional

from storage import fs as fsutil
from storage.checkpoints import CheckpointError, latest_iteration, load_checkpoint
from storage.layout import RunLayout, iteration_name


def check_latest(layout: RunLayout) -> tuple[Optional[int], Optional[CheckpointError]]:
    """The latest committed iteration and, when any of its files fails its size or sha256 check, the error."""
    latest = latest_iteration(layout)
    if latest is None:
        return None, None
    try:
        load_checkpoint(layout, latest)
    except CheckpointError as err:
        return latest, err
    return latest, None


def quarantine(layout: RunLayout, iteration: int) -> str:
    """Move committed checkpoint `iteration` to <run>/quarantine/ (a rename locally, copy + delete on S3);
    the commit markers then name iteration-1 the latest. Returns the quarantine folder's URL."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = fsutil.join(layout.run_dir, "quarantine", f"{iteration_name(iteration)}-{stamp}")
    layout.fs.makedirs(fsutil.join(layout.run_dir, "quarantine"), exist_ok=True)
    layout.fs.mv(layout.checkpoint_dir(iteration), dest, recursive=True)
    previous = latest_iteration(layout)
    if previous is not None:
        fsutil.write_json(
            layout.fs,
            layout.latest_path,
            {"iteration": previous, "uri": layout.url(layout.checkpoint_dir(previous)), "repaired_from": iteration},
        )
    else:
        fsutil.remove_files(layout.fs, [layout.latest_path])
    return layout.url(dest)
