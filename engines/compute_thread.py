"""One thread for a process's stage compute, where stage bodies would otherwise run on whatever thread calls them.

Why: torch's CPU kernels run on OpenMP (libgomp), which keeps a team of threads per thread that has run a
parallel region. When the process's teams together hold more threads than there are cores, libgomp stops
spinning at its barriers and sleeps instead, and every small op pays a futex wake-up. A Prefect task worker runs
each task run in a thread of its own pool, so a warm worker's stage bodies ran on several threads over its life.
Measured on the 2-core machine (OMP_NUM_THREADS=2, 300 forward/backward passes of a small MLP): 0.22 s on one
thread, 1.07-1.15 s on a second thread once the first had run any op; the update of bench.overhead's batch
workload took 4.4-5.4 s on the main thread and 8.9-10.4 s on a new thread. With every body on one thread the
process keeps one team. (OMP_DYNAMIC=true avoids the sleep by shrinking teams to the load, which here meant one
thread: 7.7-9.0 s for the same update.)

    pin_to_one_thread()      this process's stage bodies run on one long-lived thread from now on (warm workers)
    run(fn, *args, **kw)     fn(*args, **kw) there when pinned (the caller waits), else right here
    runs_here()              whether run would call fn on this thread

Not pinned by default: the in-process pipeline with max_staleness 0 runs its bodies on the flow's thread; with
k >= 1 its iterations run on the task runner's threads, and pinning them would serialize the rollout and the
update that k >= 1 overlaps, so they are left as they are. A body's exception is raised in the caller; its
context variables are copied to the compute thread. The thread is not a daemon: a process that exits while a body
runs waits for that body.
"""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

T = TypeVar("T")
_PREFIX = "ppoflow-compute"
_executor: Optional[ThreadPoolExecutor] = None
_lock = threading.Lock()


def pin_to_one_thread() -> None:
    """Run this process's stage bodies on one thread from now on (idempotent)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_PREFIX)


def runs_here() -> bool:
    """Whether `run` would call its function on this thread: the process is not pinned, or this is its thread."""
    return _executor is None or threading.current_thread().name.startswith(_PREFIX)


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread when the process is pinned (here when this is that thread)."""
    if runs_here():
        return fn(*args, **kwargs)
    return _executor.submit(contextvars.copy_context().run, fn, *args, **kwargs).result()
