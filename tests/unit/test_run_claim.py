"""The run's claim (runtime/stale_runs.py): a start is refused while another process still trains the run, and
never because of a record whose process cannot be training it (this process, a retry of the same flow run, a
dead or reused pid, a flow run Prefect says ended). Records of live processes are real: a `sleep` child."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ppoflow.config import ConfigError, StorageConfig
from runtime.stale_runs import (
    RunClaimedError,
    active_record_path,
    claim_run,
    holds_run,
    release_run,
    this_process_record,
)
from storage.fs import read_json, write_json
from storage.layout import RunLayout
from storage.liveness import process_start_time

HOST = socket.gethostname()


@pytest.fixture
def live_pid():
    """The pid of a process of this host that runs for the test's length."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child.pid
    child.kill()
    child.wait()


@pytest.fixture
def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _record(pid: int, host: str = HOST, flow_run_id: str = "run-a", started="now") -> dict:
    started = process_start_time(pid) if started == "now" else started
    return {"flow_run_id": flow_run_id, "flow_run_name": "ppo-training-r", "host": host, "pid": pid, "started": started}


def _prefect_says(state):
    """A flow_run_state stand-in that answers `state` and counts its calls."""
    calls = []

    def flow_run_state(flow_run_id):
        calls.append(flow_run_id)
        return state

    flow_run_state.calls = calls
    return flow_run_state


class TestHoldsRun:
    def test_a_live_process_of_this_host_whose_flow_run_is_running_holds_the_run(self, live_pid):
        assert holds_run(_record(live_pid), "run-b", _prefect_says("RUNNING"))
        assert holds_run(_record(live_pid), "run-b", _prefect_says("PENDING"))

    def test_a_live_process_holds_the_run_when_prefect_does_not_know_its_flow_run(self, live_pid):
        # another Prefect server, a wiped database: the pid with its start time is that very process
        assert holds_run(_record(live_pid), "run-b", _prefect_says(None))

    def test_this_process_starting_the_run_again_is_no_holder(self):
        # tests and benches call the flow twice in one process
        assert not holds_run(this_process_record("run-a", None), "run-b", _prefect_says("RUNNING"))

    def test_a_retry_of_the_same_flow_run_is_no_holder(self, live_pid):
        assert not holds_run(_record(live_pid, flow_run_id="run-a"), "run-a", _prefect_says("RUNNING"))

    def test_a_dead_process_is_no_holder_and_prefect_is_not_asked(self, dead_pid):
        prefect = _prefect_says("RUNNING")  # what SIGKILL leaves
        assert not holds_run(_record(dead_pid, started=12345), "run-b", prefect)
        assert prefect.calls == []

    def test_a_reused_pid_is_no_holder(self, live_pid):
        # the record's process started at another time than the one that has its pid now
        record = _record(live_pid, started=process_start_time(live_pid) - 1)
        assert not holds_run(record, "run-b", _prefect_says("RUNNING"))

    @pytest.mark.parametrize("state", ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"])
    def test_a_live_process_whose_flow_run_ended_is_no_holder(self, live_pid, state):
        assert not holds_run(_record(live_pid), "run-b", _prefect_says(state))

    def test_a_record_without_start_time_is_held_only_on_prefect_s_word(self, live_pid):
        # a record from before start times were kept, or from a host without /proc
        assert holds_run(_record(live_pid, started=None), "run-b", _prefect_says("RUNNING"))
        assert not holds_run(_record(live_pid, started=None), "run-b", _prefect_says(None))

    @pytest.mark.parametrize("state, held", [("RUNNING", True), ("PENDING", True), ("CRASHED", False), (None, False)])
    def test_another_host_holds_the_run_while_prefect_says_its_flow_run_runs(self, state, held):
        # its processes cannot be seen from here: the pid (ours, even) says nothing
        record = _record(12345, host=f"not-{HOST}", started=99)
        assert holds_run(record, "run-b", _prefect_says(state)) is held


class TestClaimRun:
    @pytest.fixture
    def layout(self, tmp_path):
        return RunLayout(str(tmp_path), "r", StorageConfig())

    def test_the_first_start_writes_this_process_s_record(self, layout):
        assert claim_run(layout, "run-a", "ppo-training-r", _prefect_says(None)) is None
        assert read_json(layout.fs, active_record_path(layout)) == this_process_record("run-a", "ppo-training-r")

    def test_a_refused_start_names_pid_host_and_flow_run_and_writes_nothing(self, layout, live_pid):
        write_json(layout.fs, active_record_path(layout), _record(live_pid))
        with pytest.raises(RunClaimedError) as refused:
            claim_run(layout, "run-b", "ppo-training-r", _prefect_says("RUNNING"))
        assert isinstance(refused.value, ConfigError)  # `ppoflow train` prints it as one error, status 2
        message = str(refused.value)
        assert f"pid {live_pid} on host {HOST}" in message and "ppo-training-r (run-a)" in message
        assert f"kill {live_pid}" in message
        assert read_json(layout.fs, active_record_path(layout)) == _record(live_pid)

    def test_a_refusal_for_another_host_says_how_to_take_over_when_that_host_is_gone(self, layout):
        write_json(layout.fs, active_record_path(layout), _record(12345, host="gpu-7", started=99))
        with pytest.raises(RunClaimedError, match="If gpu-7 is gone") as refused:
            claim_run(layout, "run-b", None, _prefect_says("RUNNING"))
        assert f"remove {layout.url(active_record_path(layout))}" in str(refused.value)

    def test_a_dead_process_s_record_is_taken_over_and_returned(self, layout, dead_pid):
        write_json(layout.fs, active_record_path(layout), _record(dead_pid, started=12345))
        assert claim_run(layout, "run-b", None, _prefect_says("RUNNING"))["pid"] == dead_pid
        assert read_json(layout.fs, active_record_path(layout))["flow_run_id"] == "run-b"

    def test_release_removes_only_this_flow_run_s_record(self, layout, live_pid):
        claim_run(layout, "run-a", None, _prefect_says(None))
        release_run(layout, "run-other")  # a later start in this process took it over: not ours to remove
        assert read_json(layout.fs, active_record_path(layout)) is not None
        release_run(layout, "run-a")
        assert read_json(layout.fs, active_record_path(layout)) is None
        write_json(layout.fs, active_record_path(layout), _record(live_pid))
        release_run(layout, "run-a")  # another process's claim stays
        assert read_json(layout.fs, active_record_path(layout)) == _record(live_pid)
