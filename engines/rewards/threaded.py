"""A reward function in a daemon worker thread: a call that hangs times out and never holds the process.

A thread cannot be killed. `concurrent.futures.ThreadPoolExecutor` made that worse: its threads are joined
at interpreter exit (concurrent.futures registers an exit hook), so one call stuck in a loop kept
`ppoflow train` from ever exiting after it had reported the timeout. Here the worker is a daemon thread
that nothing joins: on a timeout the caller abandons it (it finishes its call, if ever, and then ends, its
result dropped) and the next call starts a fresh worker, so a retried stage never waits for the stuck one
and the process exits when its work is done. The abandoned call keeps its core busy while it runs:
`isolation: process` (engines/rewards/isolated.py) kills it instead.

Async functions run with `asyncio.run` inside the worker, so an async function that blocks is bounded by
the same timeout, and a caller already inside an event loop can call them.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from typing import Any, Callable, Optional


class CallTimedOut(TimeoutError):
    """The call did not return in time; its worker thread was abandoned (a function's own TimeoutError is
    re-raised as itself, not as this)."""


class _Job:
    """One call: its arguments, and its outcome once `done` is set."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None


class ThreadCaller:
    """`call(timeout_s, *args, **kwargs)` runs `fn` in this caller's daemon worker thread.

    Returns the function's result or re-raises its exception; raises CallTimedOut when it does not return
    in `timeout_s` (the worker is then abandoned and the next call gets a new one). `abandoned` counts the
    workers left running a timed-out call. Not for concurrent use from several threads (one caller per
    reward source, called by its stage).
    """

    def __init__(self, fn: Callable, name: str = "reward-fn"):
        self.fn, self.name = fn, name
        self._is_async = inspect.iscoroutinefunction(fn)
        self._jobs: Optional[queue.SimpleQueue] = None
        self.abandoned = 0

    def _start(self) -> queue.SimpleQueue:
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(jobs,), name=self.name, daemon=True).start()
        return jobs

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            try:
                if self._is_async:
                    job.result = asyncio.run(self.fn(*job.args, **job.kwargs))
                else:
                    job.result = self.fn(*job.args, **job.kwargs)
            except BaseException as e:  # handed to the caller, which re-raises it
                job.error = e
            job.done.set()

    def call(self, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
        if self._jobs is None:
            self._jobs = self._start()
        job = _Job(args, kwargs)
        self._jobs.put(job)
        if not job.done.wait(timeout_s):
            # Abandon the worker: the sentinel ends it after its stuck call, should that ever return.
            self._jobs.put(None)
            self._jobs = None
            self.abandoned += 1
            raise CallTimedOut(f"no answer in {timeout_s} s")
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        """Let the worker end once its queue is drained; idempotent."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
