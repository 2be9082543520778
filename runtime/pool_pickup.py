"""Waiting for a stage's flow run on a work pool, without waiting for ever when no worker is on the pool.

Prefect's server keeps a flow run of a deployment Scheduled until a worker of its work pool takes it, however
long that is: a run whose stage pool has no worker (none started, all stopped, the wrong pool name at
`prefect worker start`) used to wait without a word. A pool is READY while at least one of its workers sends
heartbeats (Prefect marks a worker OFFLINE after missing them) and NOT_READY otherwise, so the stage fails once
its flow run has not been taken and the pool has had no live worker for pipeline.deadlines.pickup_s; the flow
run is cancelled, so that a worker started later does not run it behind the training run's back.

Once a worker has taken the flow run, the stage's own deadline (tasks/deadlines.py) runs in that process. When the
flow run ends other than Completed, `stage_run_error` reads the stage's own error from its state's message.
"""

from __future__ import annotations

import time
from typing import Optional

from prefect.client.schemas.objects import FlowRun, WorkPoolStatus
from prefect.states import Cancelled

POLL_S = 2.0


# What Prefect puts before `<type>: <message>` of the exception that failed a flow or task run.
_PREFECT_PREFIXES = ("Flow run encountered an exception:", "Task run encountered an exception:")


def stage_run_error(state) -> Optional[str]:
    """The first line of the error a stage's flow run ended with, from its Prefect state's message
    ("RewardError: reward function boom.py:reward raised on row 3"), or None when the state holds none."""
    message = (getattr(state, "message", None) or "").strip()
    for prefix in _PREFECT_PREFIXES:
        if message.startswith(prefix):
            message = message[len(prefix) :].strip()
    return message.splitlines()[0] if message else None


class PoolUnserved(RuntimeError):
    """No worker took a stage's flow run on its work pool within pipeline.deadlines.pickup_s."""


def wait_for_pool_run(child: FlowRun, what: str, deployment: str, pickup_s: float) -> FlowRun:
    """The flow run `child` once it has ended (read from the API); PoolUnserved (and `child` cancelled) when it is
    still untaken while its work pool has had no live worker for `pickup_s` seconds. `what` names the stage."""
    from prefect.client.orchestration import get_client

    unserved_since: Optional[float] = None
    with get_client(sync_client=True) as client:
        pool = client.read_deployment_by_name(deployment).work_pool_name
        while True:
            child = client.read_flow_run(child.id)
            state = child.state
            if state is not None and state.is_final():
                return child
            if state is not None and not (state.is_scheduled() or state.is_pending()) or _pool_ready(client, pool):
                unserved_since = None
            else:
                now = time.monotonic()
                unserved_since = now if unserved_since is None else unserved_since
                if now - unserved_since >= pickup_s:
                    message = (
                        f"{what} was not taken by work pool {pool!r} (deployment {deployment!r}): no worker has been "
                        f"online on that pool for {now - unserved_since:.0f} s (pipeline.deadlines.pickup_s = "
                        f"{pickup_s:g} s). Start one with `prefect worker start --pool {pool}` and retry the flow run"
                    )
                    client.set_flow_run_state(child.id, Cancelled(message=message), force=True)
                    raise PoolUnserved(message)
            time.sleep(POLL_S)


def _pool_ready(client, pool: Optional[str]) -> bool:
    """Whether work pool `pool` has a live worker; True when it cannot be told (no pool, an API error)."""
    if not pool:
        return True
    try:
        return client.read_work_pool(pool).status != WorkPoolStatus.NOT_READY
    except Exception:  # noqa: BLE001 - an API hiccup is not "no worker"
        return True
