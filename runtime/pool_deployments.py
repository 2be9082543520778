"""PoolDeployments: the executor that runs a stage as a flow run of its deployment on a work pool, one per stage per
iteration (pipeline.stage_pools: {rollout: "ppo-rollout/ppo-rollout", ...}).

    PoolDeployments(cfg).run(stage, iteration, **handoffs) -> the stage's manifest

`run_deployment` starts the stage's flow (flows/stage_flows.py) on that deployment's work pool; this process waits for
it, checks its final state and reads the manifest the stage wrote to storage (its stage record). The stage flow calls
the same task in its own process (`run_stage_in_process`), so caching and retries behave as in-process; only the
process (and machine) differs. A fresh process per stage per iteration: it loads its model every iteration
(bench.pools: tens of seconds per stage on a process pool), which warm workers (runtime/workers.py, started on a
pool by the `ppo-worker-*` deployments) do not pay. What per-iteration deployments still serve: a stage whose
machine is held only while it runs (a GPU node of a shared or scale-to-zero pool, released between iterations),
docs/deploying.md.

Pickup: Prefect's server keeps a flow run of a deployment Scheduled until a worker of its work pool takes it, however
long that is: a run whose stage pool has no worker (none started, all stopped, the wrong pool name at
`prefect worker start`) used to wait without a word. A pool is READY while at least one of its workers sends
heartbeats (Prefect marks a worker OFFLINE after missing them) and NOT_READY otherwise, so the stage fails once
its flow run has not been taken and the pool has had no live worker for pipeline.deadlines.pickup_s; the flow
run is cancelled, so that a worker started later does not run it behind the training run's back.

Once a worker has taken the flow run, the stage's own deadline (tasks/deadlines.py) runs in that process. When the
flow run ends other than Completed, StageFailed carries the stage's own error, read from its state's message
(`stage_run_error`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from prefect.client.schemas.objects import FlowRun, WorkPoolStatus
from prefect.states import Cancelled

from ppoflow.config import PPOFlowConfig
from runtime.stage_runs import StageFailed
from stages.manifests import STAGE_MANIFESTS, HandOff, StageManifest
from storage.layout import layout_for
from storage.stage_records import read_stage_record

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


@dataclass(frozen=True)
class PoolDeployments:
    cfg: PPOFlowConfig

    def run(self, stage: str, iteration: int, **handoffs: HandOff) -> StageManifest:
        return self.run_on(self.cfg.pipeline.stage_pools[stage], stage, iteration, **handoffs)

    def run_on(self, deployment: str, stage: str, iteration: int, **handoffs: HandOff) -> StageManifest:
        """`stage` of `iteration` as a flow run of `deployment` -> the manifest its stage record holds; StageFailed
        naming the flow run and the stage's own error when it ends other than Completed, or is never taken."""
        from prefect.deployments import run_deployment

        params = {
            "config": self.cfg.model_dump(mode="json"),
            "iteration": iteration,
            **{name: value.model_dump(mode="json") for name, value in handoffs.items()},
        }
        name = f"{stage}-iter-{iteration}"
        child = run_deployment(name=deployment, parameters=params, timeout=0, flow_run_name=name)
        what = f"stage {stage} of iteration {iteration}"
        try:
            child = wait_for_pool_run(child, what, deployment, self.cfg.pipeline.deadlines.pickup_s)
        except PoolUnserved as unserved:
            raise StageFailed(str(unserved)) from None
        if child.state is None or not child.state.is_completed():
            state = child.state.type.value if child.state else "unknown"
            own = stage_run_error(child.state)
            where = f"flow run {child.name} ({child.id}) on deployment {deployment!r}"
            raise StageFailed(f"{what} ran as {where} and ended {state}" + (f": {own}" if own else ""), own, where)
        record = read_stage_record(layout_for(self.cfg), iteration, stage)
        if record is None:
            raise StageFailed(f"{what} completed on {deployment!r} but wrote no stage record under the run's storage")
        return STAGE_MANIFESTS[stage].model_validate(record)
