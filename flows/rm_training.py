"""The reward-model training flow: prepare, units LATEST + 1 .. N (each a cached, resumable task), export.

    ppoflow train-rm CONFIG.yaml [--set rm_train.epochs=3 ...]

A run of this flow writes, under <root>/<run>/: config.yaml, metrics.jsonl (one line per unit, "iteration"
= unit), checkpoints/iter-<unit>/{model,trainer}/ with the PPO checkpoints' commit protocol, and at the end
reward_model/: the trained HF sequence-classification folder that `reward.sources: [{kind: model, target:
<root>/<run>/reward_model}]` and `model.critic_path` load as they are, with rm_train.json (config, eval
metrics) and, with rm_train.normalize, reward_normalization.json beside the weights.
A new flow run with the same run.name resumes at LATEST + 1; a Retry of a failed run does too, and the
finished tasks come back from their cache keys (tasks/cache_keys.py). The stages (stages/reward_model.py) hand each
other typed manifests (RMPlan, RMCheckpointRef, RMUnitManifest, RMExportManifest) and run through
runtime/executors.run_stage, in this process (runtime/placement.py), each recorded as `iter-<unit>/_stages/<stage>.json`
(the prepare's as iter-000000).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from adaptations import install_process_adaptations
from engines.precision import cpu_autocast_problem
from flows.preflight_static import PreflightError, format_problems
from flows.records import read_metrics, record_metrics
from flows.run_names import named_after_run
from flows.run_root import absolute_root
from ppoflow.config import PPOFlowConfig, as_config
from runtime.executors import run_stage
from stages.manifests import RMExportManifest, RMPlan
from stages.reward_model import start_ref
from storage.checkpoints import latest_iteration, read_commit_marker
from storage.layout import layout_for


def unit_row(unit: int, plan: RMPlan, metrics: dict[str, Any], seconds: float | None) -> dict[str, Any]:
    """The metrics.jsonl line of one unit from its metrics ("iteration" first, as every line of that file)."""
    row: dict[str, Any] = {"iteration": unit, **metrics, "rm/train_pairs": plan.train_pairs}
    row.update({f"rm/dropped/{k}": v for k, v in plan.dropped.items()})
    if seconds is not None:
        row["timing/unit"] = seconds
    row["time/finished_unix"] = time.time()
    return row


def restore_last_row(layout, plan: RMPlan, latest: int | None) -> None:
    """Put the last committed unit's metrics line back when a crash came between its commit and that line.

    The commit marker's meta holds the unit's metrics (stages/reward_model.py), so the line is rebuilt from what
    was committed; only the flow's own wall time of that unit (timing/unit) is not known any more.
    """
    if latest is None or any(row["iteration"] == latest for row in read_metrics(layout)):
        return
    marker = read_commit_marker(layout, latest)
    row = unit_row(latest, plan, marker["meta"]["metrics"], seconds=None)
    record_metrics(layout, row)


def _artifact_key(cfg: PPOFlowConfig) -> str:
    return "".join(c if c.isalnum() else "-" for c in cfg.run.name.lower()) + "-rm-metrics"


@flow(name="rm-training", flow_run_name=named_after_run("rm-training"))
def rm_training(config: dict[str, Any]) -> RMExportManifest:
    """Train the reward model described by `config` (PPOFlowConfig as JSON); returns the export manifest."""
    install_process_adaptations()  # a deployment's run enters here (the CLI installed them already: idempotent)
    cfg = absolute_root(as_config(config))  # recorded absolute in config.yaml (flows/run_root.py)
    if problem := cpu_autocast_problem(cfg.model.autocast_dtype):  # bf16 emulated on this CPU: ~16x slower
        raise PreflightError(format_problems(cfg, [problem]))
    layout = layout_for(cfg)
    layout.write_config_once(cfg.to_yaml())
    logger = get_run_logger()
    plan = run_stage(cfg, "rm-prepare", 0)
    latest = latest_iteration(layout)
    restore_last_row(layout, plan, latest)
    start = (latest or 0) + 1
    logger.info(
        "reward model %s: %d train / %d eval pairs, %d steps in %d units; units %d..%d to run",
        cfg.run.name,
        plan.train_pairs,
        plan.eval_pairs,
        plan.total_steps,
        plan.units,
        start,
        plan.units,
    )
    for unit in range(start, plan.units + 1):
        started = time.perf_counter()
        manifest = run_stage(cfg, "rm-unit", unit, plan=plan, start=start_ref(cfg, unit))
        row = unit_row(unit, plan, manifest.metrics, time.perf_counter() - started)
        record_metrics(layout, row)
        create_table_artifact(
            table=[{"metric": k, "value": v} for k, v in row.items()],
            key=_artifact_key(cfg),
            description=f"{cfg.run.name}: reward-model metrics of unit {unit}",
        )
        logger.info(
            "unit %d: loss %.4f eval accuracy %s (%.1f s)",
            unit,
            row["rm/loss"],
            row.get("rm/eval_accuracy"),
            row["timing/unit"],
        )
    return run_stage(cfg, "rm-export", plan.units, plan=plan, final=start_ref(cfg, plan.units + 1))


def train_reward_model(cfg: PPOFlowConfig, console: Any = None) -> RMExportManifest:
    """Run the flow in this process and print one line per unit and where the model is on `console` (a rich
    Console; `ppoflow train-rm` passes the one its output capture leaves on the terminal). ConfigError first when
    PREFECT_API_URL names a server that does not answer (runtime/prefect_api.py)."""
    from rich.console import Console

    from runtime.prefect_api import check_prefect_api

    check_prefect_api()
    console = console or Console()
    result = rm_training(cfg.model_dump(mode="json"))
    for row in read_metrics(layout_for(cfg)):
        seconds = f"{row['timing/unit']:.1f} s" if "timing/unit" in row else ""
        console.print(
            f"unit {row['iteration']}  step {row.get('rm/step')}  loss {row['rm/loss']:.4f}  "
            f"train acc {row['rm/accuracy']:.3f}  eval acc {row.get('rm/eval_accuracy', float('nan')):.3f}  "
            f"{seconds}"
        )
    ev = result.eval
    held_out = (
        f"eval accuracy {ev['rm/eval_accuracy']:.3f} on {ev['rm/eval_pairs']} pairs, loss {ev['rm/eval_loss']:.4f}"
        if ev.get("rm/eval_pairs")
        else "no eval pairs"
    )
    console.print(f"reward model: {result.uri}  ({held_out})", highlight=False)
    console.print(f"use it:       --set 'reward.sources=[{{kind: model, target: {result.uri}}}]'")
    return result
