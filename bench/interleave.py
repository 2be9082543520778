"""Benchmark sides measured iteration by iteration in turn: one runs while the others are stopped.

Why: on these machines the speed of the host drifts by 10-30% over minutes (the same pipeline measured 6.5 and
9.9 s per iteration in two runs ten minutes apart), which drowns a 5% difference between two sides run one after
the other, even alternated run by run. Here both sides stay up (engines warm) and take turns one iteration at a
time, so each pipeline iteration has a bare iteration seconds away on the same host, and the drift cancels in
the ratio.

How: each side is a process in its own session. The controller sends SIGSTOP to that process group (the side and
everything it started: Prefect's temporary server stops with its flow) as soon as the side reports the end of an
iteration, and SIGCONT when its turn comes. A stopped side uses no CPU, so it does not slow the running side. A
side's iteration time is the wall time between two of its own iteration ends minus the time it was stopped in
between; the side reports its ends as unix times, so the controller's polling delay changes nothing.

Order: the first side's start-up and first iteration run alone, then the second's (and so on); then the turns,
the order reversed every round (A B C, C B A, ...) so that a trend over the run favours no side. Two sides are the
usual case (a variant and its baseline); four measure a baseline ratio at two commits in one run (bench.overhead
--vs), each iteration of each side a few seconds from the others' on the same host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from typing import Callable, Optional, Sequence

POLL_S = 0.01


class SideFailed(RuntimeError):
    """A side's process exited before reporting the iterations it was asked for; carries its stderr's tail."""


class Side:
    """One benchmark side: a process started in its own session, whose iteration ends `ends()` reads.

    ends: returns the unix times of the iterations this side has finished so far (in order); it is called
    every POLL_S while the side runs, so it must be cheap (a stat and a small read)."""

    def __init__(
        self, name: str, argv: list[str], ends: Callable[[], list[float]], companions: tuple[int, ...] = (), **popen
    ):
        self.name = name
        self.companions = companions  # process groups stopped and continued with this side's (its workers)
        self._ends = ends
        self.stopped: list[tuple[float, float]] = []  # (stop, cont) unix times
        self._stopped_at: Optional[float] = None
        self.started_at = time.time()  # unix time the side's process was started (its start-up begins)
        self.proc = subprocess.Popen(
            argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        # Drain both pipes on threads: a side that fills a pipe nobody reads would block mid-iteration.
        self._drains = [
            threading.Thread(target=_drain, args=(stream, sink), daemon=True)
            for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))
        ]
        for thread in self._drains:
            thread.start()

    def ends(self) -> list[float]:
        return self._ends()

    def printed(self, key: str) -> list[dict]:
        """The JSON objects this side has printed on stdout, one per line, whose first key is `key`, in order."""
        prefix = '{"' + key + '"'
        return [json.loads(line) for line in list(self.stdout) if line.startswith(prefix)]

    def result(self, key: str) -> dict:
        """The last JSON line whose first key is `key` (a side's result line); SideFailed quoting stderr if none."""
        lines = self.printed(key)
        if not lines:
            raise SideFailed(f"{self.name} printed no result:\n{''.join(self.stderr)[-4000:]}")
        return lines[-1]

    def _signal(self, sig: int) -> None:
        for group in (self.proc.pid, *self.companions):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:  # a companion that already exited: the side notices when it needs it
                pass

    def stop(self) -> None:
        self._signal(signal.SIGSTOP)
        self._stopped_at = time.time()

    def cont(self) -> None:
        self._signal(signal.SIGCONT)
        if self._stopped_at is not None:
            self.stopped.append((self._stopped_at, time.time()))
            self._stopped_at = None

    def run_until(self, done: int, timeout_s: float) -> None:
        """Let this side run (it must not be stopped) until it has finished `done` iterations, then stop it."""
        deadline = time.time() + timeout_s
        while len(self.ends()) < done:
            if self.proc.poll() is not None:
                for thread in self._drains:  # the pipes' last lines (the error) before they are quoted
                    thread.join(timeout=5)
                raise SideFailed(
                    f"{self.name} exited (rc {self.proc.returncode}) after {len(self.ends())} of {done} "
                    f"iterations:\n{''.join(self.stderr)[-4000:]}"
                )
            if time.time() > deadline:
                raise SideFailed(f"{self.name} finished {len(self.ends())} of {done} iterations in {timeout_s:.0f} s")
            time.sleep(POLL_S)
        self.stop()

    def active_seconds(self) -> list[float]:
        """Per iteration from the second on: wall time since the previous end, less the time stopped in between."""
        ends = self.ends()
        out = []
        for previous, end in zip(ends, ends[1:]):
            paused = sum(min(c, end) - max(s, previous) for s, c in self.stopped if s < end and c > previous)
            out.append(end - previous - paused)
        return out

    def finish(self, timeout_s: float) -> None:
        """Let the side run to its end (it was told how many iterations to run) and wait for it."""
        self.cont()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise SideFailed(f"{self.name} did not exit within {timeout_s:.0f} s after its last iteration")
        if self.proc.returncode != 0:
            raise SideFailed(f"{self.name} failed (rc {self.proc.returncode}):\n{''.join(self.stderr)[-4000:]}")

    def kill(self) -> None:
        self._signal(signal.SIGCONT)  # companions are the caller's to stop; they must not stay frozen
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


class MetricsEnds:
    """A pipeline side's iteration ends: `time/finished_unix` of the rows of its run's metrics.jsonl, re-read only
    when the file grew (a row still being written is left for the next call)."""

    def __init__(self, path: str):
        self.path, self._size, self._ends = path, -1, []

    def __call__(self) -> list[float]:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return []
        if size != self._size:
            with open(self.path) as f:
                rows = [json.loads(line) for line in f if line.endswith("\n")]
            self._size, self._ends = size, [r["time/finished_unix"] for r in rows if "time/finished_unix" in r]
        return self._ends


def _drain(stream, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)


def run_in_turns(
    starts: Sequence[Callable[[], Side]], iterations: int, timeout_s: float = 1800.0
) -> dict[str, list[float]]:
    """Start each side in `starts` order and run it to the end of its first iteration (then stopped), one after the
    other, then give them iterations 2..`iterations` in turns, the order reversed each round. Returns each side's
    active seconds per iteration 2..`iterations` ({side name: [...]}). Every process is gone when this returns."""
    from flows.failure import raise_on_sigterm

    sides: list[Side] = []
    previous = raise_on_sigterm()  # a `kill` of this controller must not leave a side stopped (state T) for good
    try:
        for start in starts:
            side = start()
            sides.append(side)
            side.run_until(1, timeout_s)
        for done in range(2, iterations + 1):
            for side in sides if done % 2 == 0 else sides[::-1]:
                side.cont()
                side.run_until(done, timeout_s)
        for side in sides:
            side.finish(timeout_s)
        return {side.name: side.active_seconds() for side in sides}
    finally:
        for side in sides:
            side.kill()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
