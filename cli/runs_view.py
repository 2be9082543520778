"""`ppoflow runs ls` and `ppoflow runs show RUN`: runs under a root, an iteration table, committed checkpoints, and
a run's lineage (the run it was forked from, the runs forked from it)."""

from __future__ import annotations

from rich.console import Group

from flows.records import read_metrics
from flows.tracker import tensorboard_dir_for
from ppoflow.config import StorageConfig
from ppoflow.tables import FitTable, Lines
from storage.checkpoints import is_committed, latest_iteration
from storage.fs import resolve
from storage.layout import RunLayout
from storage.lineage import fork_records, parent_of
from storage.run_identity import read_run_record


def runs_ls(root: str, storage_cfg: StorageConfig | None = None) -> FitTable:
    """One row per run under `root` (a folder holding config.yaml): run, latest committed, iterations logged, last
    reward (a FitTable: every cell whole at any width, ppoflow/tables.py)."""
    fs, path = resolve(root, storage_cfg)
    columns = [(col, "left") for col in ("run", "latest committed", "iterations logged", "last reward")]
    rows = []
    for entry in sorted(fs.ls(path, detail=False)) if fs.exists(path) else []:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(("_", ".")) or name == "cache":
            continue
        layout = RunLayout(root, name, storage_cfg)
        if not fs.exists(layout.config_path):
            continue
        metrics = read_metrics(layout)
        last = metrics[-1].get("reward/mean") if metrics else None
        rows.append([name, str(latest_iteration(layout)), str(len(metrics)), "-" if last is None else f"{last:.3f}"])
    return FitTable(f"runs under {root}", columns, rows)


def runs_show(root: str, run: str, storage_cfg: StorageConfig | None = None) -> Group:
    """Where the run's files are (one `label  value` line each, never cut), then its iteration table (a FitTable).
    `checkpoint` says "committed", "removed" (committed, then deleted by retention: run.keep_checkpoints) or "no"
    (never committed: an iteration whose commit failed, or a row of the iteration in flight)."""
    layout = RunLayout(root, run, storage_cfg)
    if not layout.fs.exists(layout.config_path):
        raise FileNotFoundError(f"no run {run!r} under {root} (no {layout.url(layout.config_path)})")
    latest = latest_iteration(layout)
    keys = ["iteration", "reward/mean", "kl/mean", "loss/policy", "loss/value", "timing/iteration"]
    rows = []
    for row in read_metrics(layout):
        cells = [row.get(k) for k in keys]
        rows.append(
            ["-" if c is None else (f"{c:.4g}" if isinstance(c, float) else str(c)) for c in cells]
            + [_checkpoint_state(layout, row["iteration"], latest)]
        )
    metrics = FitTable(f"run {run}: iterations", [(k, "right") for k in keys + ["checkpoint"]], rows)
    info = [
        ("run folder", layout.url(layout.run_dir)),
        ("LATEST", str(latest)),
        ("metrics", layout.url(layout.metrics_path)),
        ("tensorboard", tensorboard_dir_for(layout)),
        ("logs", layout.url(layout.run_dir) + "/logs/"),
        *lineage_lines(layout),
    ]
    return Group(Lines(info), metrics)


def _checkpoint_state(layout: RunLayout, iteration: int, latest: int | None) -> str:
    """ "committed", "removed" (iterations commit in order, so one at or below LATEST without its checkpoint was
    committed and then removed by retention) or "no"; "-" for row 0 (the eval before training, no checkpoint)."""
    if iteration == 0:
        return "-"
    if is_committed(layout, iteration):
        return "committed"
    return "removed" if latest is not None and iteration <= latest else "no"


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
