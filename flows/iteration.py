"""One PPO iteration as a Prefect flow run: rollout -> score -> update -> checkpoint.

Each stage is timed under `timing/<stage>` (wall time seen by the flow, orchestration included), the
iteration's metrics go to `<root>/<run>/metrics.jsonl` and to a table artifact, and the shard URIs to a
markdown artifact.
"""
from __future__ import annotations

import time
from typing import Any

from prefect import flow

from flows.artifacts import publish_iteration_artifacts
from flows.records import record_metrics
from engines.stages.manifests import StageManifest
from engines.stages.policy import policy_ref
from flows.stages import run_stage
from ppoflow.config import as_config
from storage.layout import layout_for


def iteration_metrics(iteration: int, manifests: dict[str, StageManifest], timings: dict[str, float]) -> dict[str, Any]:
    update = manifests["update"].metrics
    score = manifests["score"]
    row: dict[str, Any] = {"iteration": iteration, "reward/mean": score.reward_mean,
                           "kl/mean": update.get("kl/mean"),
                           "score/cache_hits": score.cache_hits, "score/cache_misses": score.cache_misses,
                           "rollout/rows": manifests["rollout"].rows,
                           "rollout/engine": manifests["rollout"].engine}
    row.update({k: v for k, v in update.items() if k not in row})
    row.update({f"timing/{stage}": seconds for stage, seconds in timings.items()})
    row["timing/iteration"] = sum(timings.values())
    row["time/finished_unix"] = time.time()  # per-iteration wall time incl. orchestration = diff of these
    return row


@flow(name="ppo-iteration", flow_run_name="ppo-iter-{iteration:04d}")
def ppo_iteration(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    """Run iteration `iteration` (1-based) of the run described by `config`; returns its metrics row."""
    cfg = as_config(config)
    policy = policy_ref(cfg, iteration)
    manifests: dict[str, StageManifest] = {}
    timings: dict[str, float] = {}
    stage_inputs = {
        "rollout": lambda: {"policy": policy},
        "score": lambda: {"rollout": manifests["rollout"]},
        "update": lambda: {"policy": policy, "scored": manifests["score"]},
        "checkpoint": lambda: {"update": manifests["update"]},
    }
    for stage, inputs in stage_inputs.items():
        started = time.perf_counter()
        manifests[stage] = run_stage(cfg, stage, iteration, **inputs())
        timings[stage] = time.perf_counter() - started
    row = iteration_metrics(iteration, manifests, timings)
    record_metrics(layout_for(cfg), row)
    publish_iteration_artifacts(cfg, iteration, row, {k: m.model_dump(mode="json") for k, m in manifests.items()})
    return row
