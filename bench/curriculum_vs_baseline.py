"""A curriculum run beside its no-curriculum baseline: target-level held-out accuracy against wall time.

    python -m bench.curriculum_vs_baseline --root ./runs \
        real-arithmetic-curriculum real-arithmetic-curriculum-baseline --out bench/results/curriculum_vs_baseline.png \
        [--iterations 30]

Reads each run's metrics.jsonl (both evaluate on the same held-out set: the curriculum's target level), prints one
line per evaluated iteration (seconds since the run started, level, eval/accuracy, eval/sampled_pass@k) and draws
eval/accuracy against wall time for both runs, the curriculum's level on a second axis. Wall time is the sum of the
rows' timing/iteration plus the initial eval's timing/eval (the flow's own stage times, orchestration included);
rebuilt rows (after a crash) have no timings and are left out.

Ends with one JSON line (bench/common.py emit) appended to bench/results/curriculum_vs_baseline.jsonl: per run, the
target-level accuracy before and after, its gain in points, the run's wall time, its iterations, and (curriculum)
the iterations where the level moved; baseline: the second run, trained at the target level from the start.
"""

from __future__ import annotations

import argparse
from typing import Any


def timeline(rows: list[dict[str, Any]], until: int | None = None) -> list[dict[str, Any]]:
    """The rows in iteration order with `wall_s`: seconds since the run started when the row's iteration ended; with
    `until`, only iterations <= until (a run that went on past the recipe's run.iterations)."""
    elapsed, out = 0.0, []
    for row in sorted(rows, key=lambda r: int(r["iteration"])):
        if until is not None and int(row["iteration"]) > until:
            break
        seconds = row.get("timing/iteration", row.get("timing/eval") if row["iteration"] == 0 else None)
        if seconds is None:
            continue
        elapsed += float(seconds)
        out.append({**row, "wall_s": elapsed})
    return out


def run_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's figures from its timeline: accuracy at the target level before and after, the gain in points, wall
    time and iterations, and the promotions ([iteration, level] where the trained level moved)."""
    evaluated = [r for r in rows if "eval/accuracy" in r]
    levels = [(int(r["iteration"]), int(r["curriculum/level"])) for r in rows if "curriculum/level" in r]
    first, last = evaluated[0]["eval/accuracy"], evaluated[-1]["eval/accuracy"]
    return {
        "accuracy_before": first,
        "accuracy_after": last,
        "gain_points": round(100 * (last - first), 1),
        "wall_s": round(rows[-1]["wall_s"], 1),
        "iterations": int(rows[-1]["iteration"]),
        "promotions": [[i, level] for (_, before), (i, level) in zip(levels, levels[1:]) if level != before],
    }


def _line(name: str, row: dict[str, Any]) -> str:
    passes = [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in row.items() if k.startswith("eval/sampled_pass@")]
    level = row.get("curriculum/level")
    return (
        f"{name:>40} iter {row['iteration']:>3}  {row['wall_s']:>7.0f} s  level {'-' if level is None else int(level)}"
        f"  accuracy {row['eval/accuracy']:.3f}  {' '.join(passes)}"
    )


def main(argv: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.common import emit
    from flows.records import read_metrics
    from storage.layout import RunLayout

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs=2, help="the curriculum run, then the baseline")
    parser.add_argument("--root", default="./runs")
    parser.add_argument("--out", default="bench/results/curriculum_vs_baseline.png")
    parser.add_argument("--iterations", type=int, default=None, help="read each run up to this iteration")
    args = parser.parse_args(argv)
    fig, accuracy_ax = plt.subplots(figsize=(8, 4.5))
    level_ax = accuracy_ax.twinx()
    baseline = f"{args.runs[1]}: the same recipe trained at the target level from the start"
    figures: dict[str, Any] = {"baseline": baseline}
    for side, name, style in zip(("curriculum", "no_curriculum"), args.runs, ("-", "--")):
        rows = timeline(read_metrics(RunLayout(args.root, name)), until=args.iterations)
        figures[side] = {"run": name, **run_figures(rows)}
        evaluated = [r for r in rows if "eval/accuracy" in r]
        for row in evaluated:
            print(_line(name, row))
        accuracy_ax.plot(
            [r["wall_s"] for r in evaluated], [r["eval/accuracy"] for r in evaluated], style, marker="o", label=name
        )
        levels = [r for r in rows if "curriculum/level" in r]
        if levels:
            level_ax.step(
                [r["wall_s"] for r in levels],
                [r["curriculum/level"] for r in levels],
                ":",
                where="post",
                color="grey",
                label=f"{name} level",
            )
    accuracy_ax.set(xlabel="wall time (s)", ylabel="held-out accuracy at the target level (greedy)")
    level_ax.set_ylabel("curriculum level (trained at)")
    accuracy_ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    emit("curriculum_vs_baseline", figures)


if __name__ == "__main__":
    main()
