"""`ppoflow runs ls` and `ppoflow runs show RUN`: runs under a root, an iteration table, committed checkpoints, and
a run's lineage (the run it was forked from, the runs forked from it)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from flows.records import read_metrics
from flows.tracker import tensorboard_dir_for
from ppoflow.config import StorageConfig
from storage.checkpoints import is_committed, latest_iteration
from storage.fs import resolve
from storage.layout import RunLayout
from storage.lineage import fork_records, parent_of
from storage.run_identity import read_run_record


def runs_ls(root: str, storage_cfg: StorageConfig | None = None) -> Table:
    fs, path = resolve(root, storage_cfg)
    table = Table(title=f"runs under {root}")
    for col in ("run", "latest committed", "iterations logged", "last reward"):
        table.add_column(col)
    if not fs.exists(path):
        return table
    for entry in sorted(fs.ls(path, detail=False)):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(("_", ".")) or name == "cache":
            continue
        layout = RunLayout(root, name, storage_cfg)
        if not fs.exists(layout.config_path):
            continue
        rows = read_metrics(layout)
        last = rows[-1].get("reward/mean") if rows else None
        table.add_row(name, str(latest_iteration(layout)), str(len(rows)), "-" if last is None else f"{last:.3f}")
    return table


def runs_show(root: str, run: str, storage_cfg: StorageConfig | None = None) -> Group:
    layout = RunLayout(root, run, storage_cfg)
    if not layout.fs.exists(layout.config_path):
        raise FileNotFoundError(f"no run {run!r} under {root} (no {layout.url(layout.config_path)})")
    rows = read_metrics(layout)
    metrics = Table(title=f"run {run}: iterations")
    keys = ["iteration", "reward/mean", "kl/mean", "loss/policy", "loss/value", "timing/iteration"]
    for k in keys + ["committed"]:
        metrics.add_column(k, justify="right")
    for row in rows:
        cells = [row.get(k) for k in keys]
        metrics.add_row(
            *["-" if c is None else (f"{c:.4g}" if isinstance(c, float) else str(c)) for c in cells],
            "yes" if is_committed(layout, row["iteration"]) else "no",
        )
    latest = latest_iteration(layout)
    info = Table(show_header=False)
    info.add_row("run folder", layout.url(layout.run_dir))
    info.add_row("LATEST", str(latest))
    info.add_row("metrics", layout.url(layout.metrics_path))
    info.add_row("tensorboard", tensorboard_dir_for(layout))
    info.add_row("logs", layout.url(layout.run_dir) + "/logs/")
    for label, text in lineage_lines(layout):
        info.add_row(label, text)
    return Group(info, metrics)


def lineage_lines(layout: RunLayout) -> list[tuple[str, str]]:
    """("forked from", "RUN at iteration N (ROOT)") for a fork, ("fork", "NEW at iteration N ...") per run forked
    from this one (storage/lineage.py); [] for a run with neither."""
    lines = []
    parent = parent_of(read_run_record(layout))
    if parent is not None:
        lines.append(
            (
                "forked from",
                f"{parent['run']} at iteration {parent['iteration']} ({parent['root']}); iterations "
                f"1..{parent['iteration']} are its, by reference",
            )
        )
    for record in fork_records(layout):
        pinned = record.get("iterations")
        keeps = f"keeps checkpoints {pinned}" if pinned else "refers to no checkpoint any more"
        lines.append(
            ("fork", f"{record.get('run')} at iteration {record.get('forked_at')} ({record.get('root')}): {keeps}")
        )
    return lines
