"""Seconds per stage of each side of the latest real-model peer run (bench.peer_real), as one stacked-bar PNG.

    python -m bench.stage_plot        (bench.report calls it)

Reads the newest line of bench/results/peer_real.jsonl that holds `sides.*.stage_s` and writes
bench/results/peer_real_stage_seconds.png: one bar per side, one segment per stage (steady medians, as the
line holds them). Returns None, writing nothing, when no such line exists: a plot shows measured values or is
absent. Needs matplotlib (the `dev` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from bench.report import RESULTS, latest

OUT_NAME = "peer_real_stage_seconds.png"
STAGE_ORDER = ("prepare", "rollout", "sync", "score", "update", "checkpoint")  # TRL's prepare holds its scoring


def stage_seconds() -> tuple[Optional[dict], dict[str, dict[str, float]]]:
    """(the line, {side: {stage: seconds}}) of the newest peer_real line with stage seconds; (None, {}) if none."""
    lines = [ln for ln in latest("peer_real") if any("stage_s" in s for s in (ln.get("sides") or {}).values())]
    if not lines:
        return None, {}
    line = max(lines, key=lambda ln: ln.get("date", ""))
    sides = {name: dict(side["stage_s"]) for name, side in line["sides"].items() if side.get("stage_s")}
    return line, sides


def plot(out_dir: Path = RESULTS) -> Optional[Path]:
    """Write the stacked bars; the path written, or None without a line to plot."""
    line, sides = stage_seconds()
    if not sides:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s for s in STAGE_ORDER if any(s in v for v in sides.values())]
    stages += sorted({s for v in sides.values() for s in v} - set(stages))
    names = list(sides)
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    left = [0.0] * len(names)
    for stage in stages:
        widths = [sides[n].get(stage, 0.0) for n in names]
        ax.barh(names, widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per iteration (steady median per stage)")
    ax.set_title(f"SmolLM2-135M GRPO, stage seconds by side ({line.get('date', '')[:10]}, {line.get('commit')})")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = out_dir / OUT_NAME
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(plot())
