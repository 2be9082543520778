"""Stage leases (tasks/leases.py): when the submitting flow calls a warm worker dead, by hand."""

import os
import signal
import socket
import subprocess
import time

from storage.layout import RunLayout
from storage.liveness import pid_alive
from tasks import leases


def test_a_killed_unreaped_process_is_not_alive():
    child = subprocess.Popen(["sleep", "30"])
    assert pid_alive(child.pid)
    os.kill(child.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert not pid_alive(child.pid)  # a zombie until reaped: dead all the same
    child.wait()
    assert not pid_alive(child.pid)


def test_who_is_dead():
    now = 1_000_000.0
    here, elsewhere = socket.gethostname(), "another-machine"
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert leases.lease_holder_dead(None, now) is None  # no worker took the stage yet: wait on
    fresh_here = {"host": here, "pid": os.getpid(), "heartbeat_unix": now - 1}
    assert leases.lease_holder_dead(fresh_here, now) is None
    gone = leases.lease_holder_dead({"host": here, "pid": dead.pid, "heartbeat_unix": now}, now)
    assert gone == f"worker {here}:{dead.pid} is gone (no such process on this host)"
    # Another machine's process cannot be looked up: its heartbeat decides, STALE_S = 60 s.
    assert leases.lease_holder_dead({"host": elsewhere, "pid": 1, "heartbeat_unix": now - 59}, now) is None
    late = leases.lease_holder_dead({"host": elsewhere, "pid": 1, "heartbeat_unix": now - 61}, now)
    assert late == f"worker {elsewhere}:1 sent no heartbeat for 61 s"


def test_only_a_worker_holds_a_lease_and_it_is_cleared(tmp_path, monkeypatch):
    layout = RunLayout(str(tmp_path), "run")
    with leases.stage_lease(layout, 3, "update"):
        assert leases.read_lease(layout, 3, "update") is None  # in-process: the flow's own process
    monkeypatch.setitem(leases._serving, "worker", True)
    with leases.stage_lease(layout, 3, "update"):
        lease = leases.read_lease(layout, 3, "update")
        assert (lease["host"], lease["pid"]) == (socket.gethostname(), os.getpid())
        assert time.time() - lease["heartbeat_unix"] < 5
    assert leases.read_lease(layout, 3, "update") is None  # released when the stage ends (issue 56: left behind)
    try:
        with leases.stage_lease(layout, 3, "update"):
            raise RuntimeError("the stage failed")
    except RuntimeError:
        pass
    assert leases.read_lease(layout, 3, "update") is None  # a failed stage releases it too
    leases.clear_lease(layout, 3, "update")
    assert leases.read_lease(layout, 3, "update") is None
    leases.clear_lease(layout, 3, "update")  # nothing to clear: no error
