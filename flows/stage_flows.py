"""The stage flows: one Prefect flow per stage, the entrypoints of the per-iteration stage deployments of prefect.yaml
(`ppo-rollout`, `ppo-eval`, `ppo-score`, `ppo-update`, `ppo-checkpoint`, each on its own work pool).

A training run with `pipeline.stage_pools` starts one of these per stage and iteration (`PoolDeployments`,
runtime/pool_deployments.py); each runs the stage's task in its own process (`run_stage_in_process`), so caching and
retries behave as in-process; only the process (and machine) differs.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow, flow

from adaptations import install_process_adaptations
from ppoflow.config import as_config
from runtime.stage_runs import run_stage_in_process
from stages.manifests import (
    CheckpointManifest,
    EvalManifest,
    PolicyRef,
    RolloutManifest,
    ScoreManifest,
    UpdateManifest,
)


# One flow per stage, for deployments on their own pools (prefect.yaml). Explicit, typed signatures: Prefect
# validates the JSON parameters back into manifests, and its parameter schema (the UI form) names each input.
# A deployment's run enters at one of these: each installs the process's adaptations first (adaptations/).
def _sampling_stage_flow(stage: str, returns: type) -> Flow:
    """The flow of a stage whose one input is the policy it samples with: rollout, and eval (the rollout engine)."""

    def stage_flow(config: dict[str, Any], iteration: int, policy: PolicyRef):
        install_process_adaptations()
        return run_stage_in_process(as_config(config), stage, iteration, policy=policy)

    stage_flow.__name__ = stage_flow.__qualname__ = f"{stage}_stage"
    stage_flow.__annotations__["return"] = returns
    return flow(stage_flow, name=f"ppo-{stage}", flow_run_name=f"{stage}-iter-{{iteration}}")


rollout_stage = _sampling_stage_flow("rollout", RolloutManifest)


@flow(name="ppo-score", flow_run_name="score-iter-{iteration}")
def score_stage(config: dict[str, Any], iteration: int, rollout: RolloutManifest) -> ScoreManifest:
    install_process_adaptations()
    return run_stage_in_process(as_config(config), "score", iteration, rollout=rollout)


@flow(name="ppo-update", flow_run_name="update-iter-{iteration}")
def update_stage(config: dict[str, Any], iteration: int, policy: PolicyRef, scored: ScoreManifest) -> UpdateManifest:
    install_process_adaptations()
    return run_stage_in_process(as_config(config), "update", iteration, policy=policy, scored=scored)


@flow(name="ppo-checkpoint", flow_run_name="checkpoint-iter-{iteration}")
def checkpoint_stage(config: dict[str, Any], iteration: int, update: UpdateManifest) -> CheckpointManifest:
    install_process_adaptations()
    return run_stage_in_process(as_config(config), "checkpoint", iteration, update=update)


eval_stage = _sampling_stage_flow("eval", EvalManifest)
