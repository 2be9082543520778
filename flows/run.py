"""Entry points behind `ppoflow train` and `ppoflow demo`: run the training flow and show progress."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ppoflow.config import PPOFlowConfig, load_config

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
_COLUMNS = [("iteration", "iter", "{}"), ("reward/mean", "reward", "{:.3f}"), ("kl/mean", "kl", "{:.4f}"),
            ("timing/rollout", "rollout s", "{:.1f}"), ("timing/score", "score s", "{:.1f}"),
            ("timing/update", "update s", "{:.1f}"), ("timing/checkpoint", "ckpt s", "{:.1f}")]


def _fmt(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def _watch(cfg: PPOFlowConfig, stop: threading.Event, progress: Progress, task_id, seen: list) -> None:
    """Poll metrics.jsonl and advance the bar; the flow itself stays free of display code."""
    from flows.records import read_metrics
    from storage.layout import layout_for

    layout = layout_for(cfg)
    while not stop.wait(1.0):
        try:
            rows = read_metrics(layout)
        except Exception:  # the file is rewritten whole; a read may race the first write
            continue
        for row in rows[len(seen):]:
            seen.append(row)
            progress.console.print("  ".join(f"{label} {_fmt(row, k, f)}" for k, label, f in _COLUMNS))
        progress.update(task_id, completed=len(rows))


def summary_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="iterations")
    for _, label, _ in _COLUMNS:
        table.add_column(label, justify="right")
    for row in rows:
        table.add_row(*[_fmt(row, k, f) for k, _, f in _COLUMNS])
    return table


def train(cfg: PPOFlowConfig, console: Console | None = None) -> dict[str, Any]:
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for

    console = console or Console()
    seen: list = []
    stop = threading.Event()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task_id = progress.add_task(f"run {cfg.run.name}", total=cfg.run.iterations)
        watcher = threading.Thread(target=_watch, args=(cfg, stop, progress, task_id, seen), daemon=True)
        watcher.start()
        try:
            result = ppo_training(cfg.model_dump(mode="json"))
        finally:
            stop.set()
            watcher.join()
    layout = layout_for(cfg)
    console.print(summary_table(read_metrics(layout)))
    console.print(f"shards:      {layout.url(layout.run_dir)}/iter-*/{{rollout,scored,experience}}/")
    console.print(f"checkpoints: {layout.url(layout.checkpoints_dir)}/")
    console.print(f"metrics:     {layout.url(layout.metrics_path)}")
    console.print(f"inspect:     ppoflow shards stats {layout.url(layout.stage_dir(cfg.run.iterations, 'scored'))}")
    return result


def demo(overrides: list[str], root: str = "./runs") -> dict[str, Any]:
    """Build the tiny model and the digits dataset under ROOT (once), then train on the embedded default."""
    from engines.toy.model import ensure_tiny_llama
    from engines.toy.task import ensure_digits_dataset

    root_path = os.path.abspath(root)
    model_dir = ensure_tiny_llama(os.path.join(root_path, "_models", "tiny-llama"))
    data_dir = ensure_digits_dataset(os.path.join(root_path, "_data", "digits"))
    base = [f"run.root={root_path}", f"model.policy_path={model_dir}", f"data.path={data_dir}"]
    cfg = load_config(DEMO_CONFIG, base + list(overrides))
    return train(cfg)
