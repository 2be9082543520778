"""Where a stage of an iteration runs: `placement`, the one place that decides (runtime/stage_runs.py runs the stage
there). Decided from the config alone, and for a fork's rollout from its run.json (storage/lineage.py)."""

from __future__ import annotations

from typing import Literal

from ppoflow.config import PPOFlowConfig
from runtime.update_group import starts_update_group
from storage.layout import layout_for
from storage.lineage import rollout_owner

# The stage tasks that run where another stage's workers run: eval samples with the rollout engine, so the warm
# workers serving rollout serve it too (runtime/workers.py), and so they do a split rollout's parts.
WORKER_STAGE = {"eval": "rollout", "rollout-part": "rollout"}


GROUP_STAGES = ("update", "checkpoint")  # what the run's own update group serves (runtime/update_group.py)


Placement = Literal["replay", "pool", "parts", "worker", "group", "process"]


def placement(cfg: PPOFlowConfig, stage: str, iteration: int) -> Placement:
    """Where `stage` of `iteration` runs; the first that applies, in this order:

        replay   rollout of an iteration that this run, a fork, replays from its parent (its run.json, read through
                 storage/lineage.py): nothing is sampled, the parent's manifest is taken (runtime/replay.py)
        pool     pipeline.stage_pools names the stage: a flow run of that deployment on its work pool
        parts    rollout with pipeline.rollout_parts > 1: a task run per part, each placed as "rollout-part" (on
                 the rollout's warm workers, or in-process), then the merge in-process
        worker   pipeline.stage_workers names the stage, or the stage whose workers run it (WORKER_STAGE: eval and
                 a rollout part go where rollout goes): a warm worker
        group    update and checkpoint of a run whose training flow starts its own update group (train.num_ranks > 1,
                 update on no worker or pool: runtime/update_group.starts_update_group): that torchrun group
        process  the stage task in this process (the default)

    Everything else is decided from the config. The reward-model stages (rm-prepare, rm-unit, rm-export) always come
    out "process": pipeline.stage_pools and pipeline.stage_workers take only the PPO stages' names (the config
    refuses `stage_pools: {rm-unit: ...}` or `stage_workers: [rm-unit]` when it is built, naming the field), since
    no deployment per RM stage exists and `ppoflow worker` serves only the PPO stages' tasks. A train-rm run whose
    config sends PPO stages to pools or workers trains its reward model in-process all the same."""
    if stage == "rollout" and rollout_owner(layout := layout_for(cfg), iteration) is not layout:
        return "replay"
    if (cfg.pipeline.stage_pools or {}).get(stage):
        return "pool"
    if stage == "rollout" and cfg.pipeline.rollout_parts > 1:
        return "parts"
    if WORKER_STAGE.get(stage, stage) in cfg.pipeline.stage_workers:
        return "worker"
    if stage in GROUP_STAGES and starts_update_group(cfg):
        return "group"
    return "process"
