"""PNG plots of the peer benchmark: reward against iteration and against seconds, mean over seeds.

    python -m bench.plots            # reads bench/results/peer_trl_curves_tiny.json (bench/peer_trl.py writes it)

Writes bench/results/peer_trl_tiny_reward_vs_iteration.png and ..._vs_seconds.png and returns their paths.
Needs matplotlib (the `dev` extra); raises ModuleNotFoundError saying so, FileNotFoundError naming the
curves file when the benchmark has not run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import RESULTS_DIR


def mean_curves(curves: dict) -> dict[str, dict[str, list[float]]]:
    """trainer -> {"iteration", "reward", "seconds"}: means over the seeds, up to the shortest successful run."""
    by_trainer: dict[str, list[list[dict]]] = {}
    for run in curves["runs"]:
        if run["ok"] and run["iterations"]:
            by_trainer.setdefault(run["trainer"], []).append(run["iterations"])
    out = {}
    for trainer, runs in by_trainer.items():
        n = min(len(r) for r in runs)
        out[trainer] = {
            "iteration": [runs[0][k]["iteration"] for k in range(n)],
            "reward": [sum(r[k]["reward_mean"] for r in runs) / len(runs) for k in range(n)],
            "seconds": [sum(r[k]["wall_s"] for r in runs) / len(runs) for k in range(n)],
        }
    return out


def plot(size: str = "tiny") -> list[Path]:
    path = RESULTS_DIR / f"peer_trl_curves_{size}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run `python -m bench.peer_trl --size {size}` first")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("bench.plots needs matplotlib: pip install -e '.[dev]'") from e
    curves = mean_curves(json.loads(path.read_text()))
    written = []
    for x_key, label in (("iteration", "iteration"), ("seconds", "wall seconds (one thread)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for trainer, curve in sorted(curves.items()):
            ax.plot(curve[x_key], curve["reward"], label=trainer)
        ax.set_xlabel(label)
        ax.set_ylabel("mean digits reward (over seeds)")
        ax.set_title(f"peer_trl --size {size}")
        ax.legend(fontsize="small")
        out = RESULTS_DIR / f"peer_trl_{size}_reward_vs_{x_key}.png"
        fig.savefig(out, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny")
    for out in plot(p.parse_args(argv).size):
        print(out)


if __name__ == "__main__":
    main()
