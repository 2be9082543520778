"""`ppoflow train` runs the training flow as a run of the deployment `ppo-training/ppoflow-train`.

A flow run with no deployment has no Retry button in Prefect's UI (the button needs `deploymentId`) and
`prefect flow-run retry ID` asks for its entry point. So `ppoflow train` does what a deployment run does,
in its own process:

    train_through_deployment(config_json)    register the deployment (idempotent), create a flow run of it with
                                             the config as its parameter, in state Pending (so no runner takes
                                             it: this process runs it), and run that flow run here
    serve_deployment()                       `ppoflow serve`: Prefect's Runner for the same deployment; executes
                                             the runs that a Retry (UI or `prefect flow-run retry ID`) or the
                                             UI's "Run" puts in Scheduled, each in a subprocess
    ensure_crash_automation(heartbeat_s)     Prefect's own zombie detection: an automation that sets a run of
                                             the deployment Crashed when its heartbeats stop (SIGKILL, lost host)
    schedule_deployment_run(config_json, name)   `ppoflow deploy-run`: a Scheduled flow run of any deployment of the
                                             training flow (prefect.yaml's `ppo-training/ppo-training` on its
                                             pool) with a config validated here; a worker of its pool runs it
    ppo_fork / fork_deployment()             `ppo-fork/ppoflow-fork`, served by `ppoflow serve` beside the training
                                             deployment: a fork started from the UI ("Run", a form with run, at,
                                             name, root, set, replay), made by flows/fork.py and trained as a
                                             subflow run of the training flow

Why a served deployment (no work pool): the training flow already runs where `ppoflow train` starts it; a
work pool would need a worker to run it and an image or a path to pull the code from. A served deployment
needs neither, and its runs carry everything a retry needs: the parameters (the whole config) and the
entry point `flows.training.ppo_training` (a module path: the runner can run it from any folder).

Heartbeats: Prefect's flow engine emits `prefect.flow-run.heartbeat` every `flows.heartbeat_frequency`
seconds (Prefect's default 180). `ppoflow train` uses HEARTBEAT_S unless PREFECT_FLOWS_HEARTBEAT_FREQUENCY
is set, and the automation expects the next heartbeat (or the run's end) within MISSED_BEATS beats, so a
killed run turns Crashed about 2 minutes after its last heartbeat and can then be retried.

Failure modes: no Prefect API (the server is down) fails at `apply()` with Prefect's connection error,
before any work; the automation's creation failing (an old server without automations) is logged and the
run goes on (the next start of the run still marks the dead run Crashed: runtime/stale_runs.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Any
from uuid import UUID

DEPLOYMENT_NAME = "ppoflow-train"
FORK_DEPLOYMENT_NAME = "ppoflow-fork"
HEARTBEAT_S = 30  # Prefect's minimum
MISSED_BEATS = 3
AUTOMATION_NAME = "ppoflow: crash ppoflow-train runs whose heartbeat stopped"

logger = logging.getLogger(__name__)


def _served_deployment():
    """The served deployment `ppo-training/ppoflow-train`, as `ppoflow train` registers it and `ppoflow serve`
    runs it (one definition, so serving it never rewrites what registering it set)."""
    from prefect.types.entrypoint import EntrypointType

    from flows.training import ppo_training

    return ppo_training.to_deployment(
        name=DEPLOYMENT_NAME,
        entrypoint_type=EntrypointType.MODULE_PATH,
        description="Runs started by `ppoflow train`; `ppoflow serve` executes their retries.",
    )


def register_deployment() -> UUID:
    """Create or update the served deployment `ppo-training/ppoflow-train`; returns its id."""
    return _served_deployment().apply()


def heartbeat_seconds() -> int:
    """The heartbeat period of the training flow run: PREFECT_FLOWS_HEARTBEAT_FREQUENCY when set, else HEARTBEAT_S."""
    from prefect.settings import get_current_settings

    if os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY"):
        return int(get_current_settings().flows.heartbeat_frequency or HEARTBEAT_S)
    return HEARTBEAT_S


def ensure_crash_automation(deployment_id: UUID, heartbeat_s: int) -> None:
    """Create, once per server, the automation that sets a heartbeat-less run of the deployment Crashed."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    within = timedelta(seconds=heartbeat_s * MISSED_BEATS)
    try:
        existing = Automation.read(name=AUTOMATION_NAME)
    except ValueError:  # Prefect: "Automation not found"
        existing = None
    if existing is not None and existing.trigger.within == within:
        return
    if existing is not None:
        existing.delete()  # another heartbeat period: the window follows it
    ended = [f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")]
    Automation(
        name=AUTOMATION_NAME,
        description=f"No heartbeat for {heartbeat_s * MISSED_BEATS} s: the process that ran it died.",
        trigger=EventTrigger(
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            # Only the runs of this deployment: other flows on the server keep their own heartbeat periods.
            match_related=ResourceSpecification({"prefect.resource.id": f"prefect.deployment.{deployment_id}"}),
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *ended},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=within,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {heartbeat_s * MISSED_BEATS} s: the process that ran it died; "
                "retry it (UI Retry or `prefect flow-run retry ID`, with `ppoflow serve` running) or run the "
                "same `ppoflow train` command again",
            )
        ],
    ).create()


def train_through_deployment(config_json: dict[str, Any]) -> dict[str, Any]:
    """Run the training flow for `config_json` here, as a flow run of the `ppoflow-train` deployment."""
    from prefect.client.orchestration import get_client
    from prefect.context import SettingsContext, get_settings_context
    from prefect.flow_engine import run_flow
    from prefect.states import Pending

    from flows.training import ppo_training

    deployment_id = register_deployment()
    heartbeat_s = heartbeat_seconds()
    try:
        ensure_crash_automation(deployment_id, heartbeat_s)
    except Exception as e:  # noqa: BLE001 - detection is a convenience; the run itself does not need it
        logger.warning("could not create the automation that marks dead runs Crashed: %s", e)
    parameters = {"config": config_json}
    with get_client(sync_client=True) as client:
        # Pending, not Scheduled: a `ppoflow serve` running meanwhile must not take this run; this process runs it.
        flow_run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters, state=Pending())
    outer = get_settings_context()
    settings = outer.settings.copy_with_update(updates={"flows.heartbeat_frequency": heartbeat_s})
    with SettingsContext(profile=outer.profile, settings=settings):
        try:
            return run_flow(ppo_training, flow_run=flow_run, parameters=parameters)
        except BaseException as error:  # the failure message offers this flow run's Retry (flows/failure.py)
            with contextlib.suppress(AttributeError):  # an exception type with __slots__: no retry line
                error.ppoflow_flow_run = {"name": flow_run.name, "id": str(flow_run.id)}
            raise


def serve_deployment() -> None:
    """`ppoflow serve`: execute the Scheduled runs of `ppoflow-train` (retries, UI runs) and of `ppoflow-fork` (forks
    started from the UI) until interrupted."""
    from prefect import serve

    serve(_served_deployment(), fork_deployment())


def fork_deployment():
    """The served deployment `ppo-fork/ppoflow-fork` (see ppo_fork); `ppoflow serve` registers and runs it."""
    from prefect.types.entrypoint import EntrypointType

    from flows.fork_flow import ppo_fork

    return ppo_fork.to_deployment(
        name=FORK_DEPLOYMENT_NAME,
        entrypoint_type=EntrypointType.MODULE_PATH,
        description="Fork a run at a committed iteration with changed settings and train the fork (flows/fork.py).",
    )


def schedule_deployment_run(config_json: dict[str, Any], name: str):
    """Create a flow run of deployment `name` (FLOW/DEPLOYMENT) with `config_json` as its `config` parameter, as
    `ppoflow train` passes it, and return it (a FlowRun, Scheduled: a worker of the deployment's pool runs it).
    Relative paths in the config stay relative: they resolve in the folder the flow run runs in. ConfigError,
    with nothing created, when no PREFECT_API_URL is set or the server does not know the deployment or a deployment
    of the config's `pipeline.stage_pools` (one line each, listing the deployments it knows)."""
    from prefect.deployments import run_deployment
    from prefect.settings import get_current_settings

    from flows.preflight import unknown_deployments
    from ppoflow.config import ConfigError

    if not get_current_settings().api.url:
        raise ConfigError(
            "deploy-run needs PREFECT_API_URL: the Prefect server where `prefect deploy` created the deployment "
            "and its workers poll (e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api)"
        )
    # The stage deployments too, before anything is scheduled: a misspelt one failed the run on its pool ~50 s later.
    pools = (config_json.get("pipeline") or {}).get("stage_pools") or {}
    named = {"--deployment": name, **{f"pipeline.stage_pools.{stage}": d for stage, d in pools.items()}}
    if problems := unknown_deployments(named):
        raise ConfigError("\n".join(problems))
    flow_name = name.split("/", 1)[0]  # the training flows name their runs <flow>-<run.name> (flows/run_names.py)
    return run_deployment(
        name=name,
        parameters={"config": config_json},
        flow_run_name=f"{flow_name}-{config_json['run']['name']}",
        timeout=0,  # return once created: the worker runs it
    )
