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

A function that tries to end the process fails its call instead, as FunctionExited ("called sys.exit(3)"):
`sys.exit` raises SystemExit, which the worker catches like any exception; `os._exit` would end the process
at once, from any thread, with no message, so `guard_os_exit` replaces `os._exit` with a function that
raises in a reward worker thread of this process and exits as before everywhere else (other threads, a child
forked from the worker). What no thread can stop: a signal that kills the process, a crash in native code
(a segfault), `os._exit` bound before the guard was installed or called from a thread the function started.
`isolation: process` (engines/rewards/isolated.py) turns those into an error naming the call too.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import queue
import threading
from typing import Any, Callable, Optional


class CallTimedOut(TimeoutError):
    """The call did not return in time; its worker thread was abandoned (a function's own TimeoutError is
    re-raised as itself, not as this)."""


class FunctionExited(RuntimeError):
    """The function tried to end the process (sys.exit, os._exit) or raised a BaseException that is not an
    Exception; the message says which: "called sys.exit(3)", "called os._exit(7)"."""


class _ExitCalled(BaseException):
    """os._exit called in a reward worker thread (see `guard_os_exit`). A BaseException, so the function's own
    `except Exception:` does not swallow it on its way out."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


_worker = threading.local()  # `pid` is set in reward worker threads: the process that started them
_real_os_exit: Optional[Callable[[int], None]] = None


def guard_os_exit() -> None:
    """Replace `os._exit` so that, called in a reward worker thread of this process, it raises instead of ending
    the process (the call then fails as FunctionExited); anywhere else it is the real `os._exit`. Idempotent.
    Installed before the reward module is imported, so a module that binds `from os import _exit` gets it."""
    global _real_os_exit
    if _real_os_exit is not None:
        return
    real = _real_os_exit = os._exit

    @functools.wraps(real)
    def _exit(status: int) -> None:
        if getattr(_worker, "pid", None) == os.getpid():  # not in a child forked from a worker
            raise _ExitCalled(status)
        real(status)

    os._exit = _exit


def describe_exit_request(error: BaseException) -> str:
    """ "called sys.exit(3)", "called os._exit(7)", or "raised KeyboardInterrupt: ..." for another BaseException."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({'' if error.code is None else repr(error.code)})"
    if isinstance(error, _ExitCalled):
        return f"called os._exit({error.status})"
    return f"raised {type(error).__name__}: {error}"


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
    in `timeout_s` (the worker is then abandoned and the next call gets a new one), FunctionExited when it
    called sys.exit or os._exit (or raised another BaseException). `abandoned` counts the
    workers left running a timed-out call. Not for concurrent use from several threads (one caller per
    reward source, called by its stage).
    """

    def __init__(self, fn: Callable, name: str = "reward-fn"):
        self.fn, self.name = fn, name
        self._is_async = inspect.iscoroutinefunction(fn)
        self._jobs: Optional[queue.SimpleQueue] = None
        self.abandoned = 0

    def _start(self) -> queue.SimpleQueue:
        guard_os_exit()
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(jobs,), name=self.name, daemon=True).start()
        return jobs

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        _worker.pid = os.getpid()
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
        if isinstance(job.error, Exception):
            raise job.error
        if job.error is not None:  # SystemExit, os._exit: re-raised here it would end the caller's process
            raise FunctionExited(describe_exit_request(job.error)) from None
        return job.result

    def close(self) -> None:
        """Let the worker end once its queue is drained; idempotent."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
