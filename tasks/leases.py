"""Stage liveness: how the flow that submitted a stage to a warm worker learns that the worker died, or that no
worker serves the stage at all.

A worker process killed mid-stage (SIGKILL, OOM, a lost machine) tells Prefect nothing: its task run stays
Running and the submitting flow would wait for it forever. So a stage running on a worker (`ppoflow worker`
calls `serve_as_worker()`) holds a lease beside the iteration's stage records,
`<run>/iter-NNNNNN/_stages/<stage>.lease.json` = {host, pid, heartbeat_unix}, refreshed every HEARTBEAT_S
seconds by a daemon thread while the stage body runs, and removed when it ends. The submitting side
(runtime/stage_runs.py) clears the previous attempt's lease before it submits, and reads the lease while it waits:
the worker is dead when the lease names a process of this host that no longer runs, or when its heartbeat is
older than STALE_S (a worker on another machine).

In-process stages hold no lease: their process is the flow's.

A lease says nothing while no worker has taken the submission, and Prefect's server queues a submission for as
long as it takes: one whose only worker died (idle, or mid-stage with more submissions queued behind) would wait
forever. So a worker is also present: it holds one subscription to the server for as long as it runs, on a
presence key per task it serves (runtime/workers.py); the server lists it (`/task_workers/filter`) while that
connection lives and forgets it within a second or two of the process's death. Prefect's own listing of task
workers cannot tell: a warm worker holds its subscription for work only while its slot is free, so a busy
worker is not listed there. `serving_workers` reads the presence listing; runtime/stage_runs.py fails a submission
that nobody has taken while no worker has been present for its task for pipeline.deadlines.pickup_s seconds.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from typing import Any, Iterator, Optional

from storage.fs import join, read_json, write_json
from storage.layout import RunLayout
from storage.liveness import ProcessMark, this_process, why_dead

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
        write_json(layout.fs, path, asdict(this_process(heartbeat=True)))

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
        # Released when the stage ends, done or failed: a lease left behind after a run only puzzles the reader of
        # _stages/. (One of a worker killed mid-stage stays, as the evidence; the next attempt clears it.)
        try:
            clear_lease(layout, iteration, stage)
        except Exception:  # a storage hiccup must not turn a stage that ended into a failure
            pass


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


def presence_key(task_key: str) -> str:
    """The key a worker serving Prefect task `task_key` holds a subscription on, busy or idle (no run is ever
    scheduled under it)."""
    return f"ppoflow-presence/{task_key}"


def presence_id() -> str:
    """How this process is listed as present: `host:pid`, as leases and stage manifests name a worker."""
    return this_process().name


def serving_workers(task_key: str) -> Optional[list[str]]:
    """The workers (`host:pid`) present at the Prefect server now that serve task `task_key`, busy or idle; None
    when the server cannot say (an API without the task-worker listing, a request that failed): the caller then
    waits as if one were."""
    from prefect.client.orchestration import get_client

    body = {"task_worker_filter": {"task_keys": [presence_key(task_key)]}}
    try:
        with get_client(sync_client=True) as client:
            response = client.request("POST", "/task_workers/filter", json=body)
        return sorted(worker["identifier"] for worker in response.json())
    except Exception:  # noqa: BLE001 - see the docstring: no answer is not "no worker"
        return None


def lease_holder_dead(lease: Optional[dict[str, Any]], now: Optional[float] = None) -> Optional[str]:
    """Why the worker holding `lease` is dead (storage/liveness.py: its process gone on this host, or no heartbeat
    for STALE_S on any host), or None when it lives or no worker has taken the stage yet."""
    if lease is None:
        return None
    mark = ProcessMark.of(lease)
    why = why_dead(mark, STALE_S, now)
    return f"worker {mark.name} {why}" if why else None
