"""The stage tasks (rollout, score, update, checkpoint; eval after the checkpoint): thin Prefect wrappers
around stages (one function per stage). With pipeline.rollout_parts > 1 the rollout runs as
rollout-part task runs (one per part) and a rollout-merge (stages/rollout_parts.py).

Each task declares its cache key (tasks/cache_keys.py) and persists its result, a typed manifest, as JSON
under the run's storage (tasks/results.py sets where, per run, when the flow configures the task); its
body is one call of `_in_stage`, which validates the config and calls the stage function, looked up on its module
at call time, under the stage's lease (tasks/leases.py), within its deadline (tasks/deadlines.py), on the task's own
thread (on a warm worker that is the process's one task thread: runtime/workers.py says why it must be one).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from prefect import task

from ppoflow.config import PPOFlowConfig, as_config
from stages import checkpoint as checkpoint_stage
from stages import evaluate as eval_stage
from stages import rollout as rollout_stage
from stages import rollout_parts
from stages import score as score_stage
from stages import update as update_stage
from stages.manifests import (
    CheckpointManifest,
    EvalManifest,
    PolicyRef,
    RolloutManifest,
    RolloutPartManifest,
    ScoreManifest,
    UpdateManifest,
)
from storage.layout import layout_for
from tasks.cache_keys import cache_key_fn
from tasks.deadlines import deadline
from tasks.leases import stage_lease

Config = PPOFlowConfig | dict[str, Any]
T = TypeVar("T")


def _stage_task(stage: str, body, run_name: str = ""):
    return task(
        body,
        name=stage,
        task_run_name=run_name or f"{stage}-iter-{{iteration}}",
        cache_key_fn=cache_key_fn(stage),
        persist_result=True,
        result_serializer="json",
    )


def _in_stage(config: Config, iteration: int, stage: str, body: Callable[..., T], *args, lease: str = "") -> T:
    """What every stage task body does around its stage function: body(cfg, iteration, *args) under the stage's lease
    (`lease`, else the stage's name: on a warm worker, the flow finds it if the process dies), within its deadline,
    right here, one frame below the task's body and one above the stage function."""
    cfg = as_config(config)
    with stage_lease(layout_for(cfg), iteration, lease or stage), deadline(cfg, iteration, stage):
        return body(cfg, iteration, *args)


def _rollout(config: Config, iteration: int, policy: PolicyRef) -> RolloutManifest:
    return _in_stage(config, iteration, "rollout", rollout_stage.run_rollout, policy)


def _rollout_part(config: Config, iteration: int, policy: PolicyRef, part: int, parts: int) -> RolloutPartManifest:
    lease = lease_name("rollout-part", {"part": part, "parts": parts})  # each part's worker is found
    return _in_stage(config, iteration, "rollout", rollout_parts.run_rollout_part, policy, part, parts, lease=lease)


def _rollout_merge(config: Config, iteration: int, parts: list[RolloutPartManifest]) -> RolloutManifest:
    return rollout_parts.merge_rollout_parts(as_config(config), iteration, parts)


def lease_name(task_name: str, parameters: dict[str, Any]) -> str:
    """The lease (and stage record) name of a stage task run from its task's name and parameters: a rollout part's
    own name, else the task's."""
    return part_stage_name(parameters["part"], parameters["parts"]) if task_name == "rollout-part" else task_name


def part_stage_name(part: int, parts: int) -> str:
    """The name of rollout part `part` of `parts` in stage records and leases (`_stages/<name>.json`)."""
    return f"rollout-part-{part:05d}-of-{parts:05d}"


def _score(config: Config, iteration: int, rollout: RolloutManifest) -> ScoreManifest:
    return _in_stage(config, iteration, "score", score_stage.run_score, rollout)


def _update(config: Config, iteration: int, policy: PolicyRef, scored: ScoreManifest) -> UpdateManifest:
    return _in_stage(config, iteration, "update", update_stage.run_update, policy, scored)


def _checkpoint(config: Config, iteration: int, update: UpdateManifest) -> CheckpointManifest:
    return _in_stage(config, iteration, "checkpoint", checkpoint_stage.run_checkpoint, update)


def _eval(config: Config, iteration: int, policy: PolicyRef) -> EvalManifest:
    return _in_stage(config, iteration, "eval", eval_stage.run_eval, policy)  # on a warm rollout worker too


STAGE_TASKS = {
    "rollout": _stage_task("rollout", _rollout),
    # pipeline.rollout_parts > 1: the rollout as parts (each its own task run), then the merge (no engine)
    "rollout-part": _stage_task("rollout-part", _rollout_part, "rollout-iter-{iteration}-part-{part}"),
    "rollout-merge": _stage_task("rollout-merge", _rollout_merge),
    "score": _stage_task("score", _score),
    "update": _stage_task("update", _update),
    "checkpoint": _stage_task("checkpoint", _checkpoint),
    "eval": _stage_task("eval", _eval),
}
