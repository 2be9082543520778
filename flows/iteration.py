"""One PPO iteration as a Prefect flow run: rollout -> score -> update -> checkpoint (-> eval when due).

Each stage is timed under `timing/<stage>` (wall time seen by the flow, orchestration included), the
iteration's metrics go to `<root>/<run>/metrics.jsonl` (the training flow publishes them, with the shard URIs,
as an artifact of the training run). A stage's error is raised as StageError naming the stage and iteration.

The metrics row is written after the commit (it holds the checkpoint's timing), so a process killed
between the two leaves a committed iteration without its row; the next start of the run rebuilds that row
from the iteration's stage records (`recover_missing_rows`): every committed iteration has its row once.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from adaptations.prefect_sigterm import redeliver_lost_sigterm
from flows.failure import StageError
from flows.records import read_metrics, record_metrics
from ppoflow.config import as_config
from runtime.executors import executors_for, run_stage
from runtime.in_flight import mark_committed, wait_for_previous
from runtime.replay import replayed_rollout
from stages.evaluate import eval_due
from stages.manifests import STAGE_MANIFESTS, PolicyRef, StageManifest
from stages.policy import behaviour_policy_ref, policy_ref
from storage.checkpoints import read_commit_marker
from storage.layout import RunLayout, layout_for
from storage.lineage import own_first_iteration
from storage.stage_records import read_stage_record


def iteration_metrics(
    iteration: int, manifests: dict[str, StageManifest], timings: dict[str, float] | None
) -> dict[str, Any]:
    """The metrics row of an iteration; timings None (a row rebuilt after a crash) leaves timing/* out."""
    update = manifests["update"].metrics
    score = manifests["score"]
    row: dict[str, Any] = {
        "iteration": iteration,
        "reward/mean": score.reward_mean,
        "kl/mean": update.get("kl/mean"),
        "score/cache_hits": score.cache_hits,
        "score/cache_misses": score.cache_misses,
        "rollout/rows": manifests["rollout"].rows,
        "rollout/engine": manifests["rollout"].engine,
    }
    row.update({k: v for k, v in update.items() if k not in row})
    row.update(manifests["rollout"].metrics)  # timing/rollout_serve and _sample; dynamic sampling's rollout/*
    if "eval" in manifests:
        row.update(manifests["eval"].metrics)  # eval/reward_mean, eval/pass@k
    if timings is not None:
        row.update({f"timing/{stage}": seconds for stage, seconds in timings.items()})
        row["timing/iteration"] = sum(timings.values())
        row["time/finished_unix"] = time.time()  # per-iteration wall time incl. orchestration = diff of these
    return row


def recover_missing_rows(layout: RunLayout, committed_through: int) -> list[int]:
    """Write the rows of committed iterations 1..committed_through that metrics.jsonl lacks, rebuilt from their
    stage records (rollout, score, update); returns their iterations. Such a row has no timing/* keys (the
    flow's view of the stage times died with the process) and carries "record/rebuilt": true."""
    have = {row["iteration"] for row in read_metrics(layout)}
    rebuilt = []
    # A fork's iterations up to its fork point are its parent's: their rows are in the parent's metrics.jsonl.
    for iteration in range(own_first_iteration(layout), committed_through + 1):
        if iteration in have:
            continue
        records = {stage: read_stage_record(layout, iteration, stage) for stage in ("rollout", "score", "update")}
        if any(record is None for record in records.values()):
            continue  # nothing to rebuild from (records removed by hand): the row stays absent, never invented
        if (eval_record := read_stage_record(layout, iteration, "eval")) is not None:
            records["eval"] = eval_record
        manifests = {stage: STAGE_MANIFESTS[stage].model_validate(record) for stage, record in records.items()}
        record_metrics(layout, {**iteration_metrics(iteration, manifests, None), "record/rebuilt": True})
        rebuilt.append(iteration)
    return rebuilt


def rerun_missing_evals(cfg, layout: RunLayout, committed_through: int) -> list[int]:
    """Run the evals that committed iterations 1..committed_through lost; returns their iterations.

    An iteration's eval runs after its commit and before its metrics row, so a process that dies in between
    leaves the iteration committed with neither (the resume starts after it). Such an eval (due, no eval
    record, no row) runs again here with the policy that iteration committed, before recover_missing_rows
    rebuilds the row with it. When retention has removed that checkpoint, the eval cannot be redone: the row is
    rebuilt without eval/* (absent, never invented).
    """
    have = {row["iteration"] for row in read_metrics(layout)}
    ran = []
    for iteration in range(own_first_iteration(layout), committed_through + 1):
        if iteration in have or not eval_due(cfg, iteration) or read_stage_record(layout, iteration, "eval"):
            continue
        if read_commit_marker(layout, iteration) is None:
            continue  # removed by retention
        run_stage(cfg, "eval", iteration, policy=policy_ref(cfg, iteration + 1))
        ran.append(iteration)
    return ran


def evaluate_initial_policy(cfg, layout: RunLayout) -> None:
    """eval.before_training: the eval stage on the initial policy (version 0), recorded as the metrics row of
    iteration 0 (eval/* and timing/eval only); skipped when that row exists (a resumed start)."""
    if any(row["iteration"] == 0 for row in read_metrics(layout)):
        return
    started = time.perf_counter()
    manifest = run_stage(cfg, "eval", 0, policy=policy_ref(cfg, 1))
    record_metrics(layout, {"iteration": 0, **manifest.metrics, "timing/eval": time.perf_counter() - started})


def _trained_policy(cfg, iteration: int) -> PolicyRef:
    """The policy the update trains: the one committed at iteration-1, waited for when that iteration is in
    flight (pipelined iterations); RuntimeError when it is not committed."""
    wait_for_previous(cfg, iteration)
    return policy_ref(cfg, iteration)


@flow(name="ppo-iteration", flow_run_name="{config[run][name]}/iter-{iteration:04d}")
def ppo_iteration(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    """Run iteration `iteration` (1-based) of the run described by `config`; returns its metrics row."""
    cfg = as_config(config)
    manifests: dict[str, StageManifest] = {}
    timings: dict[str, float] = {}
    stage_inputs = {
        # The behaviour policy: the one it starts from, or with pipeline.max_staleness = k the one committed at
        # iteration-1-k (flows/pipeline.py).
        "rollout": lambda: {"policy": behaviour_policy_ref(cfg, iteration)},
        "score": lambda: {"rollout": manifests["rollout"]},
        "update": lambda: {"policy": _trained_policy(cfg, iteration), "scored": manifests["score"]},
        "checkpoint": lambda: {"update": manifests["update"]},
    }
    if eval_due(cfg, iteration):  # the held-out prompts, after the commit, with its policy
        stage_inputs["eval"] = lambda: {"policy": policy_ref(cfg, iteration + 1)}
    executors = executors_for(cfg)  # where each stage runs (runtime/executors.py)
    for stage, inputs in stage_inputs.items():
        redeliver_lost_sigterm()  # a SIGTERM Python dropped stops the run here, not after 200 more iterations
        started = time.perf_counter()
        try:
            # a fork replaying its parent's saved rollout samples nothing: the parent's manifest (runtime/replay.py)
            replayed = replayed_rollout(cfg, iteration) if stage == "rollout" else None
            manifests[stage] = replayed if replayed is not None else executors[stage].run(stage, iteration, **inputs())
        except Exception as error:  # the flow's state message names the stage and iteration (flows/failure.py)
            raise StageError(stage, iteration, error) from error
        timings[stage] = time.perf_counter() - started
        if stage == "checkpoint":
            mark_committed(cfg, iteration)  # pipelined iterations: the next update may start (runtime/in_flight.py)
    row = iteration_metrics(iteration, manifests, timings)
    record_metrics(layout_for(cfg), row)
    return row
