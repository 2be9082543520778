"""One process trains a run at a time, and Prefect learns that a run's process died.

The claim: the training flow records itself in `<root>/<run>/_active.json` (its flow run id and name, host,
pid and the process's start time) before any work, and removes the record when the flow ends, failed or not.
A start that finds the record of a process still training the run is refused at once with RunClaimedError,
naming that pid, host and flow run and what to do. Before, two commands on one run both trained until one died
at commit with a CheckpointError. A record is taken over (the start goes on) when its process cannot be
training the run any more: it is this very process (a test or bench calling the flow again, a retry run in
the same process), the start is a retry of the same flow run, the pid is gone or now belongs to a process
started at another time (a reused pid), or Prefect says its flow run ended. A record of another host is
refused only while Prefect says its flow run is Running or Pending (this process cannot see that host's
processes): if that host died, its flow run turns Crashed when its heartbeats stop (flows/deployment.py) and
the next start takes over; or remove the record to take over at once. When Prefect does not know the flow
run (another Prefect server, a wiped database), a live process of this host with the recorded start time
holds the run. The check and the write are not atomic: two starts within the same few milliseconds can both
go on, and the later commit then fails with a CheckpointError as before (nothing is lost).

Crashed in Prefect: a process killed with SIGKILL (the OOM killer, a lost machine) cannot tell Prefect
anything: its flow run, iteration subflow and task runs stay Running for good, and Prefect refuses to retry a
Running run. The start that takes over the record of a dead process of this host sets what it left Running
or Pending to Crashed with a message that says what happened. Prefect's heartbeat automation covers other
hosts (flows/deployment.py), but it sets only the flow run Crashed: its retry finds the children here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Callable, Iterator, Optional

from ppoflow.config import ConfigError
from storage.fs import join, read_json, remove_files, write_json
from storage.layout import RunLayout
from storage.liveness import ProcessMark, this_process, why_dead

LIVE_STATES = ("RUNNING", "PENDING")

log = logging.getLogger(__name__)


class RunClaimedError(ConfigError):
    """Another process still trains this run: this start is refused before any work (see the module docstring)."""


def active_record_path(layout: RunLayout) -> str:
    return join(layout.run_dir, "_active.json")


def this_process_record(flow_run_id: Optional[str], flow_run_name: Optional[str]) -> dict[str, Any]:
    me = this_process()
    return {
        "flow_run_id": flow_run_id,
        "flow_run_name": flow_run_name,
        "host": me.host,
        "pid": me.pid,
        "started": me.started,
    }


def is_dead_here(record: dict[str, Any]) -> bool:
    """True when `record` names a process of this host that no longer runs (its pid gone, or reused by a process
    started at another time: storage/liveness.py). A claim keeps no heartbeat: another host's is Prefect's to judge."""
    mark = ProcessMark.of(record)
    return mark.here and why_dead(mark) is not None


def holds_run(
    record: dict[str, Any], flow_run_id: Optional[str], flow_run_state: Callable[[str], Optional[str]]
) -> bool:
    """Whether the process of `record` still trains the run, so that flow run `flow_run_id` must not start it.

    flow_run_state(id): the state type Prefect gives that flow run ("RUNNING", "COMPLETED", ...), None when it
    does not know it; asked last, only when this host cannot decide alone."""
    previous_run = record.get("flow_run_id")
    if previous_run and previous_run == flow_run_id:  # a retry of the same flow run
        return False
    here = record.get("host") == socket.gethostname()
    if here and (int(record.get("pid", -1)) == os.getpid() or is_dead_here(record)):
        return False
    state = flow_run_state(previous_run) if previous_run else None
    if state is not None:
        return state in LIVE_STATES
    return here and record.get("started") is not None  # a live process, the one that wrote the record


def refusal(record: dict[str, Any], layout: RunLayout) -> str:
    """RunClaimedError's message: who holds the run, and what to do."""
    pid, host = record.get("pid"), record.get("host")
    flow_run = f"flow run {record.get('flow_run_name') or '?'} ({record.get('flow_run_id')})"
    held = f"run {layout.run_name!r} is being trained by pid {pid} on host {host} ({flow_run}); this start was refused"
    if host == socket.gethostname():
        return f"{held}. Wait for it to end, or stop it (kill {pid}: the run resumes from its last commit), then retry."
    return (
        f"{held}. Wait for it to end, or stop it on {host}, then start again. If {host} is gone: its flow run turns "
        f"Crashed when its heartbeats stop (`ppoflow train`'s automation, ~90 s) and the next start takes the run "
        f"over; to take it over now, remove {layout.url(active_record_path(layout))}."
    )


def claim_run(
    layout: RunLayout,
    flow_run_id: Optional[str],
    flow_run_name: Optional[str] = None,
    flow_run_state: Optional[Callable[[str], Optional[str]]] = None,
) -> Optional[dict[str, Any]]:
    """Record this process as the run's active one; returns the previous record (None if there was none).

    Raises RunClaimedError, writing nothing, when the previous record's process still trains the run
    (`holds_run`; flow_run_state defaults to asking this process's Prefect API)."""
    previous = read_json(layout.fs, active_record_path(layout))
    if previous and holds_run(previous, flow_run_id, flow_run_state or prefect_flow_run_state):
        raise RunClaimedError(refusal(previous, layout))
    write_json(layout.fs, active_record_path(layout), this_process_record(flow_run_id, flow_run_name))
    return previous


def release_run(layout: RunLayout, flow_run_id: Optional[str]) -> None:
    """Remove the run's record when it is still this process's for flow run `flow_run_id` (a later start may have
    taken it over). A failure to remove is logged, never raised: it must not replace the flow's own outcome, and
    the record it leaves is taken over at the next start (Prefect says the flow run ended)."""
    try:
        record = read_json(layout.fs, active_record_path(layout)) or {}
        mine = this_process_record(flow_run_id, None)
        if all(record.get(key) == mine[key] for key in ("flow_run_id", "host", "pid")):
            remove_files(layout.fs, [active_record_path(layout)])
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("could not release the run's claim %s: %s", layout.url(active_record_path(layout)), e)


@contextlib.contextmanager
def claimed_run(layout: RunLayout) -> Iterator[Optional[dict[str, Any]]]:
    """Claim the run for the current flow run (`claim_run`) for the `with` block, released when it ends however
    it ends (`release_run`); yields the previous record."""
    from prefect.runtime import flow_run

    flow_run_id = str(flow_run.id) if flow_run.id else None
    previous = claim_run(layout, flow_run_id, flow_run.name)
    try:
        yield previous
    finally:
        release_run(layout, flow_run_id)


def prefect_flow_run_state(flow_run_id: str) -> Optional[str]:
    """The state type of flow run `flow_run_id` in this process's Prefect API; None when it does not know the run
    (another Prefect server, a wiped database)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run_id)
    except ObjectNotFound:
        return None
    return run.state.type.value if run.state is not None else None


def mark_crashed(flow_run_id: str, message: str, children_only: bool = False) -> list[str]:
    """Set the flow run and its Running/Pending subflow runs and task runs to Crashed; returns their names.

    children_only: leave the flow run itself as it is (it is running again: a retry of it found what its dead
    process left Running; Prefect would reattach a subflow to a Running parent task run, not start it anew).
    A flow run no longer Running or Pending is left as it is too.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.states import Crashed

    marked: list[str] = []
    with get_client(sync_client=True) as client:
        root = client.read_flow_run(flow_run_id)
        # A root already Crashed (Prefect's heartbeat automation) may still have children left Running.
        children_only = children_only or root.state is None or root.state.type.value not in LIVE_STATES
        live = FlowRunFilterState(type=FlowRunFilterStateType(any_=list(LIVE_STATES)))
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[root.id]), state=live)
        )
        flow_runs = [root, *subflows]
        tasks = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[fr.id for fr in flow_runs]))
        )
        for task_run in tasks:
            if task_run.state is not None and task_run.state.type.value in LIVE_STATES:
                client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
                marked.append(task_run.name)
        for flow_run in reversed(subflows if children_only else flow_runs):
            client.set_flow_run_state(flow_run.id, Crashed(message=message), force=True)
            marked.append(flow_run.name)
    return marked
