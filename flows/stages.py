"""How ppo_iteration runs one stage: as a task in-process, on a warm task worker, or as a flow run of a stage
deployment on its pool.

In-process (the default): the stage task runs inside the iteration's flow run, with retries, the stage
cache key and results persisted under the run's storage.

On a warm worker (`pipeline.stage_workers: [rollout, score, update, checkpoint]`): the same task is submitted
with `.delay()` and runs in a long-lived `ppoflow worker` process that keeps its engine between iterations
(flows/workers.py); the task run still belongs to the iteration's flow run, with the same cache key.

On a pool (`pipeline.stage_pools: {rollout: "ppo-rollout/ppo-rollout", ...}`): `run_deployment` starts the
stage's flow (below) on that deployment's work pool, waits for it, checks its final state, and reads the
manifest the stage wrote to storage. The stage flow calls the same task, so caching and retries behave
the same; only the process (and machine) differs.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from engines.stages.manifests import (
    STAGE_MANIFESTS,
    CheckpointManifest,
    EvalManifest,
    HandOff,
    PolicyRef,
    RolloutManifest,
    ScoreManifest,
    StageManifest,
    UpdateManifest,
)
from flows.records import read_stage_record, write_stage_record
from ppoflow.config import PPOFlowConfig, as_config
from storage.layout import layout_for
from tasks.leases import clear_lease, lease_holder_dead, read_lease
from tasks.results import result_storage_for
from tasks.stages import STAGE_TASKS


class StageFailed(RuntimeError):
    """A stage flow run on a work pool did not complete; names the stage, iteration and flow run."""


def run_stage_in_process(cfg: PPOFlowConfig, stage: str, iteration: int, **inputs: HandOff) -> StageManifest:
    delays = [cfg.pipeline.retry_delay_s * 2**k for k in range(cfg.pipeline.retries)] or 0
    configured = STAGE_TASKS[stage].with_options(
        retries=cfg.pipeline.retries, retry_delay_seconds=delays, result_storage=result_storage_for(cfg)
    )
    manifest = configured(cfg, iteration, **inputs)
    write_stage_record(layout_for(cfg), iteration, stage, manifest.model_dump(mode="json"))
    return manifest


def run_stage_on_pool(
    cfg: PPOFlowConfig, stage: str, deployment: str, iteration: int, **inputs: HandOff
) -> StageManifest:
    from prefect.deployments import run_deployment

    params = {
        "config": cfg.model_dump(mode="json"),
        "iteration": iteration,
        **{name: value.model_dump(mode="json") for name, value in inputs.items()},
    }
    child = run_deployment(name=deployment, parameters=params, timeout=None, flow_run_name=f"{stage}-iter-{iteration}")
    if child.state is None or not child.state.is_completed():
        state = child.state.type.value if child.state else "unknown"
        raise StageFailed(
            f"stage {stage} of iteration {iteration} ran as flow run {child.name} ({child.id}) "
            f"on deployment {deployment!r} and ended {state}"
        )
    record = read_stage_record(layout_for(cfg), iteration, stage)
    if record is None:
        raise StageFailed(
            f"stage {stage} of iteration {iteration} completed on {deployment!r} "
            f"but wrote no stage record under the run's storage"
        )
    return STAGE_MANIFESTS[stage].model_validate(record)


def run_stage_on_worker(cfg: PPOFlowConfig, stage: str, iteration: int, **inputs: HandOff) -> StageManifest:
    """Submit the stage task to the warm workers serving it and wait for its manifest (raises its error).

    The submitting side's serializer only stores the submission (parameters and Prefect's run context, which
    JSON cannot hold) in Prefect's task scheduling storage; the worker persists the result as JSON. A worker
    that dies mid-stage is found through the stage's lease (tasks/leases.py): its task run is set Crashed and
    StageFailed names the worker."""
    layout = layout_for(cfg)
    clear_lease(layout, iteration, stage)
    submit = STAGE_TASKS[stage].with_options(result_serializer="pickle")
    future = submit.delay(cfg.model_dump(mode="json"), iteration, **inputs)
    # The future's own wait follows task-run events and can return before the final state is readable (seen:
    # "has no state"); the API's view of the run is what decides.
    while not (state := future.state).is_final():
        try:
            future.wait(timeout=5)
        except RuntimeError:  # Prefect: the task run "has no state": no worker has taken the submission yet
            time.sleep(0.5)  # (several iterations in flight queue stages for one worker)
        if why := lease_holder_dead(read_lease(layout, iteration, stage)):
            message = (
                f"stage {stage} of iteration {iteration} was running on a warm worker that died: {why}. "
                f"Start `ppoflow worker --stage {stage}` again and retry the flow run: the stage reruns from the "
                f"last committed checkpoint"
            )
            _crash_task_run(future.task_run_id, message)
            raise StageFailed(message)
    manifest = state.result(raise_on_failure=True)
    write_stage_record(layout, iteration, stage, manifest.model_dump(mode="json"))
    return manifest


def _crash_task_run(task_run_id, message: str) -> None:
    """Set a task run whose process died to Crashed (it would show Running for good)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        client.set_task_run_state(task_run_id, Crashed(message=message), force=True)


def run_stage(cfg: PPOFlowConfig, stage: str, iteration: int, **inputs: HandOff) -> StageManifest:
    deployment = (cfg.pipeline.stage_pools or {}).get(stage)
    if deployment:
        return run_stage_on_pool(cfg, stage, deployment, iteration, **inputs)
    # eval samples with the rollout engine, so the warm workers serving rollout serve it too (flows/workers.py)
    if ("rollout" if stage == "eval" else stage) in cfg.pipeline.stage_workers:
        return run_stage_on_worker(cfg, stage, iteration, **inputs)
    return run_stage_in_process(cfg, stage, iteration, **inputs)


# One flow per stage, for deployments on their own pools (prefect.yaml). Explicit, typed signatures: Prefect
# validates the JSON parameters back into manifests, and its parameter schema (the UI form) names each input.
@flow(name="ppo-rollout", flow_run_name="rollout-iter-{iteration}")
def rollout_stage(config: dict[str, Any], iteration: int, policy: PolicyRef) -> RolloutManifest:
    return run_stage_in_process(as_config(config), "rollout", iteration, policy=policy)


@flow(name="ppo-score", flow_run_name="score-iter-{iteration}")
def score_stage(config: dict[str, Any], iteration: int, rollout: RolloutManifest) -> ScoreManifest:
    return run_stage_in_process(as_config(config), "score", iteration, rollout=rollout)


@flow(name="ppo-update", flow_run_name="update-iter-{iteration}")
def update_stage(config: dict[str, Any], iteration: int, policy: PolicyRef, scored: ScoreManifest) -> UpdateManifest:
    return run_stage_in_process(as_config(config), "update", iteration, policy=policy, scored=scored)


@flow(name="ppo-checkpoint", flow_run_name="checkpoint-iter-{iteration}")
def checkpoint_stage(config: dict[str, Any], iteration: int, update: UpdateManifest) -> CheckpointManifest:
    return run_stage_in_process(as_config(config), "checkpoint", iteration, update=update)


@flow(name="ppo-eval", flow_run_name="eval-iter-{iteration}")
def eval_stage(config: dict[str, Any], iteration: int, policy: PolicyRef) -> EvalManifest:
    return run_stage_in_process(as_config(config), "eval", iteration, policy=policy)
