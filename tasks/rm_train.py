"""The reward-model training tasks (rm-prepare, rm-unit, rm-export): thin Prefect wrappers around the stage bodies in
stages/reward_model.py, typed like the PPO stage tasks (tasks/stage_tasks.py).

Each takes (config, iteration, **input hand-offs), where "iteration" is the unit (0 for the prepare, which runs
before unit 1; the last unit for the export), declares the stages' one cache key (tasks/cache_keys.py: the stage's
config sections, the inputs' identities, and for the prepare the data's contents) and persists its result, a typed
manifest (stages/manifests.py: RMPlan, RMUnitManifest, RMExportManifest), as JSON under the run's storage. They run
in the flow's process (flows/stages.placement says why) and have no stage deadline: pipeline.deadlines names the
PPO stages only.
"""

from __future__ import annotations

from typing import Any

from ppoflow.config import PPOFlowConfig, as_config
from stages import reward_model
from stages.manifests import RMCheckpointRef, RMExportManifest, RMPlan, RMUnitManifest
from tasks.stage_tasks import _stage_task  # the one way a stage task is declared: name, run, cache key, result

Config = PPOFlowConfig | dict[str, Any]


def _rm_prepare(config: Config, iteration: int) -> RMPlan:
    """iteration: 0 (the plan comes before unit 1)."""
    return reward_model.run_rm_prepare(as_config(config))


def _rm_unit(config: Config, iteration: int, plan: RMPlan, start: RMCheckpointRef) -> RMUnitManifest:
    """iteration: the unit (1-based)."""
    return reward_model.run_rm_unit(as_config(config), iteration, plan, start)


def _rm_export(config: Config, iteration: int, plan: RMPlan, final: RMCheckpointRef) -> RMExportManifest:
    """iteration: the last unit (plan.units), whose checkpoint `final` names."""
    return reward_model.run_rm_export(as_config(config), plan, final)


RM_STAGE_TASKS = {
    "rm-prepare": _stage_task("rm-prepare", _rm_prepare, "rm-prepare"),
    "rm-unit": _stage_task("rm-unit", _rm_unit, "rm-unit-{iteration}"),
    "rm-export": _stage_task("rm-export", _rm_export, "rm-export"),
}
