"""Stage leases: how the flow that submitted a stage to a warm worker learns that the worker died.

A worker process killed mid-stage (SIGKILL, OOM, a lost machine) tells Prefect nothing: its task run stays
Running and the submitting flow would wait for it forever. So a stage running on a worker (`ppoflow worker`
calls `serve_as_worker()`) holds a lease beside the iteration's stage records,
`<run>/iter-NNNNNN/_stages/<stage>.lease.json` = {host, pid, heartbeat_unix}, refreshed every HEARTBEAT_S
seconds by a daemon thread while the stage body runs. The submitting side (flows/stages.py) clears the
previous attempt's lease before it submits, and reads the lease while it waits: the worker is dead when the
lease names a process of this host that no longer runs, or when its heartbeat is older than STALE_S (a worker
on another machine).

In-process stages hold no lease: their process is the flow's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

from storage.fs import join, read_json, write_json
from storage.layout import RunLayout
from storage.scratch import pid_alive

HEARTBEAT_S = 5.0
STALE_S = 60.0  # 12 missed heartbeats: a busy worker's thread still gets scheduled well within this

_serving = {"worker": False}


def serve_as_worker() -> None:
    """Mark this process a stage worker: its stage bodies hold leases from now on."""
    _serving["worker"] = True


def lease_path(layout: RunLayout, iteration: int, stage: str) -> str:
    return join(layout.iteration_dir(iteration), "_stages", f"{stage}.lease.json")


@contextmanager
def _held(layout: RunLayout, iteration: int, stage: str) -> Iterator[None]:
    path = lease_path(layout, iteration, stage)
    stop = threading.Event()

    def beat() -> None:
        write_json(layout.fs, path, {"host": socket.gethostname(), "pid": os.getpid(), "heartbeat_unix": time.time()})

    def keep_beating() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                beat()
            except Exception:  # a storage hiccup must not kill the stage; the next beat tries again
                pass

    beat()
    thread = threading.Thread(target=keep_beating, name=f"lease-{stage}-{iteration}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def stage_lease(layout: RunLayout, iteration: int, stage: str):
    """Hold the stage's lease while the block runs, when this process is a worker; else do nothing."""
    return _held(layout, iteration, stage) if _serving["worker"] else nullcontext()


def read_lease(layout: RunLayout, iteration: int, stage: str) -> Optional[dict[str, Any]]:
    return read_json(layout.fs, lease_path(layout, iteration, stage))


def clear_lease(layout: RunLayout, iteration: int, stage: str) -> None:
    """Remove a previous attempt's lease before the stage is submitted again (its worker may be long gone)."""
    path = lease_path(layout, iteration, stage)
    if layout.fs.exists(path):
        layout.fs.rm(path)


def lease_holder_dead(lease: Optional[dict[str, Any]], now: Optional[float] = None) -> Optional[str]:
    """Why the worker holding `lease` is dead, or None when it lives or no worker has taken the stage yet."""
    if lease is None:
        return None
    worker = f"{lease.get('host')}:{lease.get('pid')}"
    if lease.get("host") == socket.gethostname() and not pid_alive(int(lease.get("pid", -1))):
        return f"worker {worker} is gone (no such process on this host)"
    age = (time.time() if now is None else now) - float(lease.get("heartbeat_unix", 0))
    if age > STALE_S:
        return f"worker {worker} sent no heartbeat for {age:.0f} s"
    return None
