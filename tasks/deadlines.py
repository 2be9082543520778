"""Stage deadlines: a stage that runs past its deadline fails by name, instead of holding the run for hours.

The deadline of stage S in an iteration (pipeline.deadlines, all seconds):

    stages[S]                                   when set (0 = no deadline)
    max(floor_s, factor x median(recent))       recent = timing/S of the last `history` metrics rows that have it
    + first_s                                   the first time this process runs S (engine start-up, model load)
    first_s                                     while the run has no timing/S yet

timing/S is the stage's wall time as the flow saw it (flows/iteration.py), so queueing for a busy worker makes
the deadline longer, never shorter.

What happens at the deadline (`deadline`): the stage's body, running on the thread that called it, is
interrupted with StageDeadlineExceeded (an exception raised into that thread between two Python operations), which
fails the task run; Prefect's retries take over as for any stage error. A body blocked in native code (a socket read
without a timeout, a collective that never returns) cannot be interrupted that way: when it is still running
`grace_s` after its deadline, its process ends with exit code EXIT_DEADLINE after one message on the user's terminal
and in the log naming the stage (ppoflow/terminal.py). The run's committed iterations are untouched and it resumes
from its last checkpoint (`ppoflow train` again). On a warm worker the flow then sees the worker gone
(tasks/leases.py) and fails the stage by name; Prefect's retry sends it to a live worker.
"""

from __future__ import annotations

import ctypes
import os
import socket
import statistics
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from ppoflow.config import PPOFlowConfig
from ppoflow.terminal import last_words
from storage.layout import layout_for
from storage.metrics import read_metrics

EXIT_DEADLINE = 124  # the exit code of a process ended by a stage that did not stop at its deadline (as timeout(1))

_run_here: set[str] = set()  # stages this process has run (or started): the first gets the start-up allowance
_run_here_lock = threading.Lock()


class StageDeadlineExceeded(RuntimeError):
    """A stage ran past its deadline (pipeline.deadlines); the message names the stage, the iteration, the deadline
    and how it was derived, and the setting to raise it."""


class _Interrupt(Exception):
    """Raised into a stage's thread at its deadline (an exception type without arguments, as CPython requires);
    `deadline` turns it into StageDeadlineExceeded with the full message."""


def _base_stage(stage: str) -> str:
    """The pipeline stage a task's stage name belongs to: a rollout part (rollout-part-...) is the rollout's."""
    return stage.split("-", 1)[0]


def deadline_s(cfg: PPOFlowConfig, stage: str, recent: list[float], first_here: bool) -> tuple[Optional[float], str]:
    """The deadline of `stage` in seconds (None: none) and how it was derived, in words.

    recent: the stage's durations (seconds) of the run's last iterations, oldest first (may be empty).
    first_here: this process has not run the stage before (its engines start inside this run of it)."""
    settings = cfg.pipeline.deadlines
    base = _base_stage(stage)
    if base in settings.stages:
        fixed = settings.stages[base]
        return (fixed or None), f"pipeline.deadlines.stages.{base} = {fixed:g} s"
    if not settings.enabled:
        return None, "pipeline.deadlines.enabled = false"
    if not recent:
        return settings.first_s, f"pipeline.deadlines.first_s = {settings.first_s:g} s, the run's first {base}"
    window = recent[-settings.history :]
    median = statistics.median(window)
    derived = max(settings.floor_s, settings.factor * median)
    why = (
        f"{settings.factor:g} x the median {median:.1f} s of timing/{base} over the last {len(window)} iterations, "
        f"at least pipeline.deadlines.floor_s = {settings.floor_s:g} s"
    )
    if first_here:
        return derived + settings.first_s, f"{why}, + first_s = {settings.first_s:g} s for this process's start-up"
    return derived, why


def recent_durations(cfg: PPOFlowConfig, stage: str) -> list[float]:
    """timing/<stage> of the run's metrics rows that have it, in iteration order (a rollout part: the rollout's)."""
    key = f"timing/{_base_stage(stage)}"
    rows = sorted(read_metrics(layout_for(cfg)), key=lambda row: row["iteration"])
    return [float(row[key]) for row in rows if isinstance(row.get(key), (int, float))]


@contextmanager
def deadline(cfg: PPOFlowConfig, iteration: int, stage: str) -> Iterator[None]:
    """Stage `stage`'s deadline over the block, which must run on the thread that is to run the stage's body.

    Raises StageDeadlineExceeded (from the body's own error, when the interruption made it raise another) when the
    deadline passed; ends the process (EXIT_DEADLINE) when the block is still running grace_s later."""
    with _run_here_lock:
        first_here = stage not in _run_here
        _run_here.add(stage)
    seconds, why = deadline_s(cfg, stage, recent_durations(cfg, stage), first_here)
    if seconds is None:
        yield
        return
    what = f"stage {stage} of iteration {iteration}"
    message = (
        f"{what} ran past its deadline of {seconds:g} s ({why}) on {socket.gethostname()}:{os.getpid()}. "
        f"If it is only slow (a big model's first iteration, a slower machine), raise it with "
        f"--set pipeline.deadlines.stages.{_base_stage(stage)}=<seconds> (0 = none) or "
        f"pipeline.deadlines.first_s; if it hangs, the stage's logs say where"
    )
    watch = _Watch(seconds, cfg.pipeline.deadlines.grace_s, message)
    try:
        yield
    except BaseException as error:
        if watch.finish():
            raise StageDeadlineExceeded(message) from (None if isinstance(error, _Interrupt) else error)
        raise
    watch.finish()  # a body that swallowed the interruption and then returned: its result stands


class _Watch:
    """A timer thread that interrupts the calling thread at the deadline, and ends the process `grace_s` later
    when the call has still not returned."""

    def __init__(self, seconds: float, grace_s: float, message: str):
        self._thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.fired = False
        self._message = message
        self._timer = threading.Thread(target=self._run, args=(seconds, grace_s), name="stage-deadline", daemon=True)
        self._timer.start()

    def _run(self, seconds: float, grace_s: float) -> None:
        if self._done.wait(seconds):
            return
        with self._lock:
            if self._done.is_set():
                return
            self.fired = True
            _raise_in_thread(self._thread_id, _Interrupt)
        if self._done.wait(grace_s):
            return
        last_words(
            f"ppoflow: error: StageDeadlineExceeded: {self._message}. It did not stop within "
            f"pipeline.deadlines.grace_s = {grace_s:g} s after the deadline (blocked outside Python), so this process "
            f"ends now (exit status {EXIT_DEADLINE}); the run's committed iterations are kept: run the same command "
            f"again and it resumes from its last checkpoint"
        )
        os._exit(EXIT_DEADLINE)

    def finish(self) -> bool:
        """The call returned or raised: stop the timer; True when the deadline had fired. An interruption the timer
        had sent but the thread had not yet raised is withdrawn, so it cannot land in the caller's code."""
        while True:
            try:
                with self._lock:
                    self._done.set()
                    if self.fired:
                        _raise_in_thread(self._thread_id, None)
                return self.fired
            except _Interrupt:  # it landed here, on the way out: the call is over all the same
                continue


def _raise_in_thread(thread_id: int, exc_type: Optional[type[BaseException]]) -> None:
    """Schedule `exc_type` to be raised in thread `thread_id` at its next Python operation (None: withdraw one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else ctypes.c_void_p(0)
    )
