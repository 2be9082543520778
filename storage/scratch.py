"""Scratch folders for checkpoint saves, and the housekeeping of those a process left when it died mid-save.

A checkpoint is written into a scratch folder first and then moved (local disk) or uploaded into the run's
checkpoints folder (storage/checkpoints.py `save_checkpoint_files`). A scratch folder's name says which
process on which machine owns it, so the next save on that machine removes the folders of dead writers.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import tempfile

from storage import fs as fsutil
from storage.layout import RunLayout
from storage.liveness import ProcessMark, why_dead

log = logging.getLogger(__name__)

_SCRATCH_PREFIX = ".ppoflow-ckpt."


@functools.lru_cache(maxsize=1)
def _host_tag() -> str:
    """This machine's name as it appears in scratch folder names (letters, digits and dashes only)."""
    return "".join(c if c.isalnum() else "-" for c in socket.gethostname()) or "host"


def remove_stale_scratch(parent: str) -> list[str]:
    """Remove the scratch folders in `parent` whose writer died (a crash mid-save); returns their paths.

    A scratch folder is `.ppoflow-ckpt.<host>.<pid>.<random>`. It is stale when <host> is this machine and
    no process <pid> runs here. Folders of other machines (a shared disk) and of live processes are left
    alone; a reused pid keeps a stale folder (the safe way to be wrong). Without this, every crash during a
    save would leave a checkpoint's worth of disk (hundreds of GB for a 7B actor, critic and Adam state).
    """
    removed = []
    host = _host_tag()
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in names:
        parts = name[len(_SCRATCH_PREFIX) :].split(".") if name.startswith(_SCRATCH_PREFIX) else []
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if int(parts[1]) == os.getpid() or why_dead(ProcessMark(socket.gethostname(), int(parts[1]))) is None:
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def checkpoint_scratch(layout: RunLayout) -> tempfile.TemporaryDirectory:
    """A scratch folder to write a checkpoint into before `save_checkpoint_files(..., move=True)`.

    On local storage it sits in the run's checkpoints folder (same filesystem, so the files are renamed
    into place, not copied; its dot name keeps it out of the iteration listing); elsewhere it is in the
    system temp folder. Removed when the `with` block ends; one left by a process that died is removed by
    the next call on the same machine (`remove_stale_scratch`).
    """
    parent = tempfile.gettempdir()
    if fsutil.is_local(layout.fs):
        parent = layout.checkpoints_dir  # resolved local paths carry no protocol
        os.makedirs(parent, exist_ok=True)
    for path in remove_stale_scratch(parent):
        log.warning("removed the scratch folder %s left by a process that died while saving a checkpoint", path)
    return tempfile.TemporaryDirectory(prefix=f"{_SCRATCH_PREFIX}{_host_tag()}.{os.getpid()}.", dir=parent)
