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
from flows.iteration import ppo_iteration
from flows.preflight import preflight
from storage.checkpoints import latest_iteration
from tasks.common import as_config, layout_for


@flow(name="ppo-training", flow_run_name="ppo-training-{config[run][name]}")
def ppo_training(config: dict[str, Any]) -> dict[str, Any]:
    """Train the run described by `config` (PPOFlowConfig as JSON); returns the last metrics and the run's URI."""
    cfg = as_config(config)
    preflight(cfg)  # bad data, model folders, bucket, deployments: one clear error before any work
    layout = layout_for(cfg)
    layout.write_config_once(cfg.to_yaml())
    start = (latest_iteration(layout) or 0) + 1
    logger = get_run_logger()
    logger.info("run %s at %s: iterations %d..%d", cfg.run.name, layout.url(layout.run_dir), start,
                cfg.run.iterations)
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
        logger.info("iteration %d: reward %.3f kl %.4f (%.1f s)", iteration, row["reward/mean"],
                    row.get("kl/mean") or 0.0, row["timing/iteration"])
    return {"run_uri": layout.url(layout.run_dir), "first_iteration": start,
            "last_iteration": cfg.run.iterations, "iterations": rows}
