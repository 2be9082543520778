"""The training flow: iterations LATEST + 1 .. run.iterations, each a subflow run `ppo-iter-NNNN`.

Starting at LATEST + 1 makes a new flow run with the same run name a resume, and a Retry of a failed
flow run (UI, `prefect flow-run retry`) skips committed iterations entirely and, inside the failed one,
the stages whose results are cached.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.context import SettingsContext, get_settings_context

from flows.artifacts import start_progress, update_progress
from flows.iteration import ppo_iteration, recover_missing_rows
from flows.preflight import preflight
from flows.stale_runs import claim_run, is_dead_here, mark_crashed
from ppoflow.config import as_config
from storage.checkpoints import latest_iteration
from storage.layout import layout_for


@flow(name="ppo-training", flow_run_name="ppo-training-{config[run][name]}")
def ppo_training(config: dict[str, Any]) -> dict[str, Any]:
    """Train the run described by `config` (PPOFlowConfig as JSON); returns the last metrics and the run's URI."""
    cfg = as_config(config)
    preflight(cfg)  # bad data, model folders, bucket, deployments: one clear error before any work
    layout = layout_for(cfg)
    layout.write_config_once(cfg.to_yaml(), defaults=type(cfg)().model_dump(mode="json"))
    start = (latest_iteration(layout) or 0) + 1
    logger = get_run_logger()
    _crash_stale_run(cfg, layout, logger)
    for iteration in recover_missing_rows(layout, start - 1):
        logger.warning(
            "iteration %d was committed but its metrics row was not written (the process died in "
            "between): rebuilt from its stage records",
            iteration,
        )
    logger.info("run %s at %s: iterations %d..%d", cfg.run.name, layout.url(layout.run_dir), start, cfg.run.iterations)
    progress = start_progress(cfg, start - 1)
    rows: list[dict[str, Any]] = []
    cfg_json = cfg.model_dump(mode="json")
    # One heartbeat thread per process is enough: this flow run's (Prefect marks it Crashed when the process
    # dies). A subflow's own heartbeat thread sleeps in 1 s steps and is joined when the subflow ends, which
    # costs ~0.25 s per iteration on average for nothing. The settings copy is made once (~50 ms).
    outer = get_settings_context()
    no_heartbeat = outer.settings.copy_with_update(updates={"flows.heartbeat_frequency": None})
    for iteration in range(start, cfg.run.iterations + 1):
        with SettingsContext(profile=outer.profile, settings=no_heartbeat):
            row = ppo_iteration(cfg_json, iteration)
        rows.append(row)
        update_progress(progress, cfg, iteration)
        kl = row.get("kl/mean")
        logger.info(
            "iteration %d: reward %.3f kl %s (%.1f s)",
            iteration,
            row["reward/mean"],
            "-" if kl is None else f"{kl:.4f}",
            row["timing/iteration"],
        )
    return {
        "run_uri": layout.url(layout.run_dir),
        "first_iteration": start,
        "last_iteration": cfg.run.iterations,
        "iterations": rows,
    }


def _crash_stale_run(cfg, layout, logger) -> None:
    """Mark the flow run of this run's previous start Crashed in Prefect when its process died (flows/stale_runs.py)."""
    from prefect.runtime import flow_run

    current = str(flow_run.id) if flow_run.id else None
    previous = claim_run(layout, current)
    if not previous or not previous.get("flow_run_id") or previous["flow_run_id"] == current:
        return
    if not is_dead_here(previous):
        return
    message = (
        f"the process that ran it (pid {previous['pid']} on {previous['host']}) died; found by the next "
        f"start of run {cfg.run.name!r} (flow run {current}), which resumed from the last commit"
    )
    try:
        marked = mark_crashed(previous["flow_run_id"], message)
    except Exception as e:  # an unknown flow run (another Prefect server, a wiped database): nothing to mark
        logger.warning("could not mark the previous flow run %s Crashed: %s", previous["flow_run_id"], e)
        return
    if marked:
        logger.warning(
            "marked %d runs of the dead process Crashed (%s); retry them with `prefect flow-run retry "
            "%s --entrypoint flows/training.py:ppo_training`",
            len(marked),
            ", ".join(marked[:4]),
            previous["flow_run_id"],
        )
