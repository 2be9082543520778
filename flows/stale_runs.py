"""Prefect learns that a run's process died: at the next start (or retry) of the same run, what it left Running is
marked Crashed, so it can be retried (UI Retry, `prefect flow-run retry ID`: flows/deployment.py).

A process killed with SIGKILL (the OOM killer, a lost machine) cannot tell Prefect anything: its flow run,
iteration subflow and task runs stay Running for good, and Prefect refuses to retry a Running run. So the
training flow leaves a small record at `<root>/<run>/_active.json` (its flow run id, host and pid) when it
starts. The next start of the same run reads it: when that flow run is still Running or Pending in Prefect
and its process is gone (same host, pid not alive), the flow run and its Running subflow and task runs are
set to Crashed with a message that says what happened. A record from another host is left alone (this
process cannot see that host's processes); Prefect's heartbeat automation covers that case
(flows/deployment.py), but it sets only the flow run Crashed: its retry finds the children here.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

from storage.fs import join, read_json, write_json
from storage.layout import RunLayout
from storage.scratch import pid_alive

LIVE_STATES = ("RUNNING", "PENDING")


def active_record_path(layout: RunLayout) -> str:
    return join(layout.run_dir, "_active.json")


def claim_run(layout: RunLayout, flow_run_id: Optional[str]) -> Optional[dict[str, Any]]:
    """Record this process as the run's active one; returns the previous record (None if there was none)."""
    previous = read_json(layout.fs, active_record_path(layout))
    write_json(
        layout.fs,
        active_record_path(layout),
        {"flow_run_id": flow_run_id, "host": socket.gethostname(), "pid": os.getpid()},
    )
    return previous


def is_dead_here(record: dict[str, Any]) -> bool:
    """True when `record` names a process of this host that no longer runs."""
    return record.get("host") == socket.gethostname() and not pid_alive(int(record.get("pid", -1)))


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
