"""`ppoflow runs plot RUN`: one PNG of a run's reward, KL and stage times against iteration.

Three panels sharing the iteration axis, read from `<root>/<run>/metrics.jsonl` (the run's record, so
it works for a run in progress, a finished one, and one on S3):
    reward   `reward/mean`
    KL       `kl/mean` (per token) and `kl/sequence_mean` (per response, what `algo.kl_target` steers)
    seconds  `timing/rollout`, `timing/score`, `timing/update`, `timing/checkpoint` stacked
A key absent from every row is left out of its panel (a metric shows a measured value or is absent).
Drawn with matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ppoflow.config import StorageConfig

STAGE_TIMINGS = ("timing/rollout", "timing/score", "timing/update", "timing/checkpoint")


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["iteration"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def plot_rows(rows: list[dict[str, Any]], out: str, title: str) -> str:
    """Draw `rows` (metrics.jsonl rows) into the PNG `out`; returns `out`. ValueError when `rows` is empty."""
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
    kl_ax.set_ylabel("KL (nats)")
    trained = [r for r in rows if int(r["iteration"]) > 0]  # row 0 is the initial policy's eval: no stages ran
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
    return plot_rows(read_metrics(layout), out or f"{run}-metrics.png", f"run {run} ({layout.url(layout.run_dir)})")
