"""`ppoflow runs plot RUN`: one PNG of a run's reward, KL and stage times against iteration.

Three panels sharing the iteration axis, read from `<root>/<run>/metrics.jsonl` (the run's record, so
it works for a run in progress, a finished one, and one on S3):
    reward   `reward/mean`
    KL       `kl/mean` (per token) and `kl/sequence_mean` (per response, what `algo.kl_target` steers)
    seconds  `timing/rollout`, `timing/score`, `timing/update`, `timing/checkpoint` stacked
A key absent from every row is left out of its panel (a metric shows a measured value or is absent).
Drawn with matplotlib's Agg backend: no display needed.

Lineage (flows/fork.py): the plot of a fork draws its parent's reward, eval accuracy and KL curves beside its own,
and the plot of a run with forks draws each fork's; a fork's curve starts at its fork point, from its parent's
value there, so the two curves part where the runs did. The stage times are the plotted run's own.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from ppoflow.config import StorageConfig

STAGE_TIMINGS = ("timing/rollout", "timing/score", "timing/update", "timing/checkpoint")


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["iteration"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


_FORK_POINT_KEYS = ("iteration", "reward/mean", "eval/reward_mean", "eval/accuracy", "kl/mean", "kl/sequence_mean")
_BESIDE_KEYS = (("reward", "reward/mean"), ("reward", "eval/accuracy"), ("kl", "kl/mean"))
Curve = tuple[str, list[dict[str, Any]]]  # (label, metrics rows) of a related run drawn beside the plotted one


def plot_rows(rows: list[dict[str, Any]], out: str, title: str, beside: Sequence[Curve] = ()) -> str:
    """Draw `rows` (metrics.jsonl rows) into the PNG `out`, with the reward/mean, eval/accuracy and kl/mean curves of
    the runs in `beside` (dashed, dotted); returns `out`. ValueError when `rows` is empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not rows:
        raise ValueError(f"{title}: no metrics rows to plot (no iteration has finished yet)")
    fig, (reward_ax, kl_ax, time_ax) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    x, y = _series(rows, "reward/mean")
    reward_ax.plot(x, y, marker=".", label="reward/mean")
    for key in ("eval/reward_mean", "eval/accuracy"):  # held-out evals, iteration 0 = before training
        x, y = _series(rows, key)
        if x:
            reward_ax.plot(x, y, marker="o", linestyle="--", label=key)
    reward_ax.set_ylabel("reward")
    for key in ("kl/mean", "kl/sequence_mean"):
        x, y = _series(rows, key)
        if x:
            kl_ax.plot(x, y, marker=".", label=key)
    for label, other in beside:
        for panel, key in _BESIDE_KEYS:
            x, y = _series(other, key)
            if x:
                ax = reward_ax if panel == "reward" else kl_ax
                ax.plot(x, y, marker=".", linestyle=":" if "eval" in key else "--", alpha=0.8, label=f"{key} ({label})")
    kl_ax.set_ylabel("KL (nats)")
    # Row 0 is the initial policy's eval (no stages ran); a fork point row is the parent's.
    trained = [r for r in rows if int(r["iteration"]) > 0 and not r.get("fork_point")]
    present = [key for key in STAGE_TIMINGS if _series(trained, key)[0]]
    if present:
        iterations = [int(r["iteration"]) for r in trained]
        stacks = [[float(r.get(key) or 0.0) for r in trained] for key in present]
        time_ax.stackplot(iterations, *stacks, labels=[k.split("/", 1)[1] for k in present], alpha=0.8)
    time_ax.set_ylabel("seconds per stage")
    time_ax.set_xlabel("iteration")
    time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (reward_ax, kl_ax, time_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out


def plot_run(root: str, run: str, out: Optional[str] = None, storage_cfg: Optional[StorageConfig] = None) -> str:
    """Plot run `run` under `root` into `out` (default `<run>-metrics.png` in the current folder).

    Raises FileNotFoundError naming the folder when there is no such run, ValueError when it has no rows.
    """
    from flows.records import read_metrics
    from storage.layout import RunLayout

    layout = RunLayout(root, run, storage_cfg)
    if not layout.fs.exists(layout.config_path):
        raise FileNotFoundError(f"no run {run!r} under {root} (no {layout.url(layout.config_path)})")
    rows, beside = lineage_curves(layout, read_metrics)
    return plot_rows(rows, out or f"{run}-metrics.png", f"run {run} ({layout.url(layout.run_dir)})", beside)


def lineage_curves(layout, read_metrics) -> tuple[list[dict[str, Any]], list[Curve]]:
    """The run's rows (a fork's led by its parent's row at the fork point) and the curves drawn beside them: its
    parent's (a fork) and each fork's (led by this run's row at its fork point). A related run whose folder is gone
    is left out: the plot shows what is there."""
    from storage import lineage
    from storage.layout import RunLayout
    from storage.run_identity import read_run_record

    def at(rows: list[dict[str, Any]], iteration: int) -> list[dict[str, Any]]:
        """The row of `iteration` as a curve's first point: its reward and KL, marked (no stage times of its own)."""
        found = [r for r in rows if r.get("iteration") == iteration][:1]
        return [{k: r[k] for k in _FORK_POINT_KEYS if k in r} | {"fork_point": True} for r in found]

    rows, beside = read_metrics(layout), []
    parent = lineage.parent_of(read_run_record(layout))
    if parent is not None:
        parent_rows = read_metrics(RunLayout(parent["root"], parent["run"], layout.storage_cfg))
        rows = at(parent_rows, int(parent["iteration"])) + rows
        beside.append((f"parent {parent['run']}", parent_rows))
    for record in lineage.fork_records(layout):
        if isinstance(record.get("root"), str) and isinstance(record.get("forked_at"), int):
            fork_rows = read_metrics(RunLayout(record["root"], record["run"], layout.storage_cfg))
            if fork_rows:
                beside.append((f"fork {record['run']}", at(rows, record["forked_at"]) + fork_rows))
    return rows, beside
