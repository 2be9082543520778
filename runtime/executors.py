"""Where a run's stages run: one Executor per stage, chosen once per run from the config (`executors_for`).

    executor.run(stage, iteration, **handoffs) -> the stage's manifest (recorded as `_stages/<stage>.json`)

    InProcess        the stage task in this process; Prefect's retries (pipeline.retries)
    WarmWorkers      the stage task on the long-lived `ppoflow worker` processes serving it (`.delay()`); a worker
                     that dies, or none that takes it, fails the stage by name (runtime/stage_runs._WorkerWatch)
    UpdateGroup      WarmWorkers on the torchrun group this flow started (train.num_ranks > 1); a failed attempt is
                     resubmitted once the group serves again (runtime/stage_runs.run_stage_on_group)
    PoolDeployments  a flow run of the stage's deployment on its work pool (pipeline.stage_pools); in its own file,
                     runtime/pool_deployments.py

Which one serves a stage is `placement` (runtime/placement.py), read once per run here. A rollout with
pipeline.rollout_parts > 1 fans its parts out inside its executor: InProcess samples them one after another (they
share its one engine), WarmWorkers submits them all before waiting (the workers sample side by side); then the merge
runs here. The replay of a fork's rollout is not an executor: the flow takes the parent's manifest instead of running
the stage (runtime/replay.py, flows/iteration.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ppoflow.config import PIPELINE_STAGES, PPOFlowConfig
from runtime.placement import placement
from runtime.pool_deployments import PoolDeployments
from runtime.replay import replayed_rollout
from runtime.stage_runs import (
    run_parts_in_process,
    run_parts_on_workers,
    run_stage_in_process,
    run_stage_on_group,
    submit_to_worker,
    wait_for_worker,
)
from stages.manifests import HandOff, StageManifest

# A replayed iteration is placed "replay" whatever else the config says; the executors are read from an iteration
# that no fork replays (placement's other rules do not depend on the iteration).
_ANY_ITERATION = 0


class Executor(Protocol):
    def run(self, stage: str, iteration: int, **handoffs: HandOff) -> StageManifest: ...


@dataclass(frozen=True)
class InProcess:
    cfg: PPOFlowConfig

    def run(self, stage: str, iteration: int, **handoffs: HandOff) -> StageManifest:
        if stage == "rollout" and self.cfg.pipeline.rollout_parts > 1:
            return run_parts_in_process(self.cfg, iteration, **handoffs)
        return run_stage_in_process(self.cfg, stage, iteration, **handoffs)


@dataclass(frozen=True)
class WarmWorkers:
    cfg: PPOFlowConfig

    def run(self, stage: str, iteration: int, **handoffs: HandOff) -> StageManifest:
        if stage == "rollout" and self.cfg.pipeline.rollout_parts > 1:
            return run_parts_on_workers(self.cfg, iteration, **handoffs)
        # Submitted here and awaited here: a reader goes from this line to the task's body (tasks/stage_tasks.py),
        # which a worker process runs; wait_for_worker ends in StageFailed when that worker dies (_WorkerWatch).
        future = submit_to_worker(self.cfg, stage, iteration, stage, **handoffs)
        return wait_for_worker(self.cfg, future, stage, iteration, stage)


@dataclass(frozen=True)
class UpdateGroup:
    cfg: PPOFlowConfig

    def run(self, stage: str, iteration: int, **handoffs: HandOff) -> StageManifest:
        return run_stage_on_group(self.cfg, stage, iteration, **handoffs)


def executor_for(cfg: PPOFlowConfig, stage: str) -> Executor:
    """The executor of `stage` (a pipeline stage, or a reward-model stage: always InProcess) in this run."""
    where = placement(cfg, stage, _ANY_ITERATION)
    if where == "parts":  # the rollout's parts go where a part goes
        where = placement(cfg, "rollout-part", _ANY_ITERATION)
    if where == "pool":
        return PoolDeployments(cfg)
    if where == "worker":
        return WarmWorkers(cfg)
    if where == "group":
        return UpdateGroup(cfg)
    return InProcess(cfg)


def run_stage(cfg: PPOFlowConfig, stage: str, iteration: int, **inputs: HandOff) -> HandOff:
    """Run `stage` of `iteration` on its executor, with its input hand-offs -> its manifest (recorded as
    `_stages/<stage>.json`); a fork's replayed rollout is the parent's manifest (runtime/replay.py). For a stage run
    outside ppo_iteration's loop (an eval rerun, the reward-model stages); raises the stage's error, or StageFailed
    from a pool or a warm worker."""
    if stage == "rollout" and (replayed := replayed_rollout(cfg, iteration)) is not None:
        return replayed
    return executor_for(cfg, stage).run(stage, iteration, **inputs)


def executors_for(cfg: PPOFlowConfig) -> dict[str, Executor]:
    """Each pipeline stage's executor, chosen once for the run."""
    return {stage: executor_for(cfg, stage) for stage in PIPELINE_STAGES}
