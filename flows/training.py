"""The training flow: iterations LATEST + 1 .. run.iterations, each a subflow run `<run>/iter-NNNN`.

Starting at LATEST + 1 makes a new flow run with the same run name a resume, and a Retry of a failed
flow run (UI, `prefect flow-run retry`) skips committed iterations entirely and, inside the failed one,
the stages whose results are cached.

A run with train.num_ranks > 1 whose update goes to no warm worker or pool has its update ranks started here, as a
torchrun group on this machine, for the flow run's duration (runtime/update_group.py).
"""

from __future__ import annotations

import traceback
from typing import Any, Optional

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from adaptations import install_process_adaptations
from engines.reasoning_tasks import materialize as materialize_generated_data
from flows.artifacts import publish_iteration_artifacts, start_progress, update_progress
from flows.iteration import evaluate_initial_policy, ppo_iteration, recover_missing_rows, rerun_missing_evals
from flows.logs import flow_run_log
from flows.pipeline import run_pipelined, subflow_settings
from flows.preflight import preflight
from flows.run_inputs import start_run
from flows.run_names import named_after_run
from flows.run_root import absolute_root
from flows.subflow_identity import keyed_by
from ppoflow.config import MAX_STALENESS, PPOFlowConfig, as_config
from runtime.stale_runs import claimed_run, is_dead_here, mark_crashed
from runtime.update_group import owned_update_group
from storage.checkpoints import latest_iteration
from storage.layout import RunLayout, layout_for


# Pipelined iterations (pipeline.max_staleness = k) run as up to k+1 task runs at once in this task runner.
@flow(
    name="ppo-training",
    flow_run_name=named_after_run("ppo-training"),
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_STALENESS + 1),
)
def ppo_training(config: dict[str, Any]) -> dict[str, Any]:
    """Train the run described by `config` (PPOFlowConfig as JSON); returns the last metrics and the run's URI."""
    install_process_adaptations()  # a deployment's run enters here (the CLI installed them already: idempotent)
    cfg = absolute_root(as_config(config))  # run.root absolute (flows/run_root.py) before config.yaml records it
    run_log = flow_run_log(cfg)  # a process Prefect started for this run (serve's Retry, a pool): its own log file
    try:
        cfg = materialize_generated_data(cfg)  # data.reasoning_gym: the .jsonl files, written once
        preflight(cfg)  # bad data, model folders, bucket, deployments: one clear error before any work
        layout = layout_for(cfg)
        with claimed_run(layout) as previous:  # refused here, before any work, while another process trains it
            with owned_update_group(cfg):  # train.num_ranks > 1, update on no worker or pool: its own torchrun group
                return _train_claimed(cfg, layout, previous)
    except BaseException:
        if run_log is not None:  # the traceback into the run log (Prefect's logger sent it to the API only)
            traceback.print_exc()
        raise
    finally:
        if run_log is not None:
            run_log.publish(cfg.storage)


def _train_claimed(cfg: PPOFlowConfig, layout: RunLayout, previous: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The training flow's work while its process holds the run (runtime/stale_runs.py); `previous`: the record of
    the process that held it before (None if none)."""
    layout.write_config_once(cfg.to_yaml(), defaults=type(cfg)().model_dump(mode="json"))
    start_run(cfg, layout)  # run.json: a run id at the first start; later starts refuse changed input contents
    start = (latest_iteration(layout) or 0) + 1
    logger = get_run_logger()
    _crash_stale_run(cfg, previous, logger)
    if start == 1 and cfg.eval.before_training and cfg.eval.data_path:
        evaluate_initial_policy(cfg, layout)
    for iteration in rerun_missing_evals(cfg, layout, start - 1):
        logger.warning(
            "iteration %d was committed but its eval was lost (the process died in between): ran it again", iteration
        )
    for iteration in recover_missing_rows(layout, start - 1):
        logger.warning(
            "iteration %d was committed but its metrics row was not written (the process died in "
            "between): rebuilt from its stage records",
            iteration,
        )
    logger.info("run %s at %s: iterations %d..%d", cfg.run.name, layout.url(layout.run_dir), start, cfg.run.iterations)
    progress = start_progress(cfg, start - 1)

    def report(row: dict[str, Any]) -> None:
        publish_iteration_artifacts(cfg, row)  # on the training run itself: no subflow to open
        update_progress(progress, cfg, row["iteration"])
        kl = row.get("kl/mean")
        logger.info(
            "iteration %d: reward %.3f kl %s (%.1f s)",
            row["iteration"],
            row["reward/mean"],
            "-" if kl is None else f"{kl:.4f}",
            row["timing/iteration"],
        )

    if cfg.pipeline.max_staleness:
        rows = run_pipelined(cfg, start, report)
    else:
        rows = []
        cfg_json = cfg.model_dump(mode="json")
        for iteration in range(start, cfg.run.iterations + 1):
            keyed_by(ppo_iteration, iteration)  # a Retry finds iteration i's subflow run again, not call i's
            with subflow_settings():
                row = ppo_iteration(cfg_json, iteration)
            rows.append(row)
            report(row)
    return {
        "run_uri": layout.url(layout.run_dir),
        "first_iteration": start,
        "last_iteration": cfg.run.iterations,
        "iterations": rows,
    }


def _crash_stale_run(cfg: PPOFlowConfig, previous: Optional[dict[str, Any]], logger) -> None:
    """Mark what this run's previous start left Running in Prefect Crashed when its process died
    (runtime/stale_runs.py): that flow run, or, when this is a retry of it, the subflow and task runs it left."""
    from prefect.runtime import flow_run

    current = str(flow_run.id) if flow_run.id else None
    if not previous or not previous.get("flow_run_id") or not is_dead_here(previous):
        return
    retry = previous["flow_run_id"] == current
    message = (
        f"the process that ran it (pid {previous['pid']} on {previous['host']}) died; found by the next "
        f"start of run {cfg.run.name!r} (flow run {current}), which resumed from the last commit"
    )
    try:
        marked = mark_crashed(previous["flow_run_id"], message, children_only=retry)
    except Exception as e:  # an unknown flow run (another Prefect server, a wiped database): nothing to mark
        logger.warning("could not mark the previous flow run %s Crashed: %s", previous["flow_run_id"], e)
        return
    if marked and retry:
        logger.warning(
            "marked %d runs left Running by the dead process Crashed (%s)", len(marked), ", ".join(marked[:4])
        )
    elif marked:
        logger.warning(
            "marked %d runs of the dead process Crashed (%s); this run resumes it (or retry flow run %s: UI "
            "Retry or `prefect flow-run retry %s`, with `ppoflow serve` running)",
            len(marked),
            ", ".join(marked[:4]),
            previous["flow_run_id"],
            previous["flow_run_id"],
        )
