"""storage/liveness.py: one answer to "does the process that left this mark still live", and every holder
(a stage lease, a run claim, a checkpoint scratch folder) gives that same answer for the same process."""

import os
import socket
import subprocess
from pathlib import Path

from runtime.stale_runs import is_dead_here
from storage.liveness import ProcessMark, pid_alive, process_start_time, this_process, why_dead
from storage.scratch import remove_stale_scratch
from tasks.leases import lease_holder_dead

HERE = socket.gethostname()


def _ended_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: the pid names no process (until the kernel reuses it, far later)
    return child.pid


def _start_ticks(pid: int) -> int:
    # /proc/PID/stat read here by hand, a second reading beside process_start_time's: field 22 after "(comm)"
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_this_host_a_live_process_an_ended_one_and_a_reused_pid():
    me = this_process()
    assert (me.host, me.pid, me.started) == (HERE, os.getpid(), _start_ticks(os.getpid()))
    assert why_dead(me) is None
    assert why_dead(ProcessMark(HERE, _ended_pid())) == "is gone (no such process on this host)"
    # the mark of a process started one tick later than the one that holds this pid now: the pid was reused
    reused = ProcessMark(HERE, os.getpid(), started=_start_ticks(os.getpid()) + 1)
    assert why_dead(reused) == "is gone (its pid now belongs to a process started later)"
    assert why_dead(ProcessMark(HERE, 0)) and why_dead(ProcessMark(HERE, -1))  # never a holder's pid
    assert not pid_alive(0) and process_start_time(_ended_pid()) is None


def test_another_host_is_judged_by_its_heartbeat_only():
    now = 5_000.0
    far = "another-machine"
    assert why_dead(ProcessMark(far, 1, heartbeat_unix=now - 30), stale_s=60, now=now) is None
    assert why_dead(ProcessMark(far, 1, heartbeat_unix=now - 90), stale_s=60, now=now) == "sent no heartbeat for 90 s"
    assert why_dead(ProcessMark(far, 1, heartbeat_unix=now - 90), now=now) is None  # heartbeats not judged
    assert why_dead(ProcessMark(far, 1)) is None  # no heartbeat: cannot tell from here, alive


def test_every_holder_gives_the_same_answer_for_the_same_process(tmp_path):
    ended = _ended_pid()
    record = {"host": HERE, "pid": ended, "heartbeat_unix": 1e12, "started": None}  # a fresh beat: only the pid decides
    assert lease_holder_dead(record) == f"worker {HERE}:{ended} is gone (no such process on this host)"
    assert is_dead_here(record)
    tag = "".join(c if c.isalnum() else "-" for c in HERE)
    dead, alive = tmp_path / f".ppoflow-ckpt.{tag}.{ended}.x", tmp_path / f".ppoflow-ckpt.{tag}.{os.getppid()}.y"
    dead.mkdir(), alive.mkdir()
    assert remove_stale_scratch(str(tmp_path)) == [str(dead)]
    assert alive.exists()
    mine = {"host": HERE, "pid": os.getpid(), "heartbeat_unix": 1e12, "started": _start_ticks(os.getpid())}
    assert lease_holder_dead(mine) is None and not is_dead_here(mine)
    mine["started"] += 1  # the same pid, another process: dead to both
    assert lease_holder_dead(mine).endswith("is gone (its pid now belongs to a process started later)")
    assert is_dead_here(mine)
