"""Whether a process that left its mark in storage still lives: the one answer for every holder ppoflow keeps.

A process that holds something writes a mark of itself beside it: `ProcessMark(host, pid, started, heartbeat_unix)`.
`why_dead(mark, stale_s)` says why that process can no longer hold it (a phrase that follows the holder's name:
"worker host:42 is gone (...)"), or None while it may:

- on this host: its pid runs no more (a zombie counts as gone), or the pid now belongs to a process started at
  another time (a reused pid; only when the mark carries `started`, the process's start in clock ticks after boot);
- on another host (whose processes this one cannot see): its heartbeat is older than `stale_s`; a mark without a
  heartbeat, or a holder that keeps none, cannot be judged from here and counts as alive (the safe way to be wrong:
  the caller then asks Prefect, or waits).

Who uses it, and what decides where this module cannot:

    holder                    its mark                                  judged by
    a stage on a warm worker  <iter>/_stages/<stage>.lease.json, a      why_dead(lease, STALE_S) in the flow that
                              heartbeat every 5 s (tasks/leases.py)     submitted it (runtime/stage_runs.py)
    a run's training flow     <run>/_active.json: pid, start time       why_dead on this host; for another host,
                              (runtime/stale_runs.py)                     Prefect's flow run state (its heartbeats and
                                                                        the Crashed automation, flows/deployment.py)
    a checkpoint save         its scratch folder's name:                why_dead (storage/scratch.py)
                              .ppoflow-ckpt.<host>.<pid>.<random>
    an idle warm worker       none                                      Prefect's listing of its presence
                                                                        subscription (tasks/leases.serving_workers)
    update ranks              none                                      torchrun's elastic agent, which restarts
                                                                        the group when a rank ends

Failure modes: /proc missing (macOS) -> `started` is None and a reused pid goes unnoticed; a pid owned by another
user exists (PermissionError) -> alive.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ProcessMark:
    """A process as a holder records itself: host name, pid, start time (clock ticks after boot; None where there
    is no /proc) and the time of its last heartbeat (None for a holder that keeps none)."""

    host: str
    pid: int
    started: Optional[int] = None
    heartbeat_unix: Optional[float] = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> "ProcessMark":
        """From a holder's JSON record ({host, pid, started?, heartbeat_unix?}); a missing pid is -1 (gone)."""
        beat = record.get("heartbeat_unix")
        return cls(
            host=str(record.get("host")),
            pid=int(record.get("pid", -1)),
            started=record.get("started"),
            heartbeat_unix=float(beat) if beat is not None else None,
        )

    @property
    def name(self) -> str:
        """`host:pid`, as leases, stage manifests and the worker presence listing name a process."""
        return f"{self.host}:{self.pid}"

    @property
    def here(self) -> bool:
        return self.host == socket.gethostname()


def this_process(heartbeat: bool = False) -> ProcessMark:
    """This process's mark (with a heartbeat stamped now when `heartbeat`)."""
    pid = os.getpid()
    return ProcessMark(socket.gethostname(), pid, process_start_time(pid), time.time() if heartbeat else None)


def why_dead(mark: ProcessMark, stale_s: Optional[float] = None, now: Optional[float] = None) -> Optional[str]:
    """Why the process of `mark` can hold nothing any more, as a phrase after its name ("is gone (no such process on
    this host)", "sent no heartbeat for 75 s"), or None while it may (see the module docstring).

    stale_s: a heartbeat older than this is a dead holder, on any host; None: heartbeats are not judged."""
    if mark.here:
        if not pid_alive(mark.pid):
            return "is gone (no such process on this host)"
        started = process_start_time(mark.pid)
        if mark.started is not None and started is not None and started != mark.started:
            return "is gone (its pid now belongs to a process started later)"
    if stale_s is not None and mark.heartbeat_unix is not None:
        age = (time.time() if now is None else now) - mark.heartbeat_unix
        if age > stale_s:
            return f"sent no heartbeat for {age:.0f} s"
    return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs; a zombie (dead, not yet reaped by its parent) does not."""
    if pid <= 0:  # os.kill(0 or -N) signals process groups: never a holder's pid
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    state = _stat_fields(pid)
    return state is None or state[0] not in (b"Z", b"X")  # no /proc (macOS): os.kill said it exists


def process_start_time(pid: int) -> Optional[int]:
    """When process `pid` of this host started, in clock ticks after boot (/proc/PID/stat field 22); None where
    there is no /proc or no such process. With the pid it names one process: a reused pid has another."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _stat_fields(pid: int) -> Optional[list[bytes]]:
    """/proc/PID/stat's fields after "(comm)" (which may hold spaces): [0] is the state; None without it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
