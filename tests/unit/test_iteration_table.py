"""The terminal's iteration table (flows/run.py IterationTable): the before-training eval row (iteration 0) is
printed by the start that ran it and is no step of the progress bar; a resumed start prints only new rows."""

from __future__ import annotations

import io
import json

from rich.console import Console
from rich.progress import Progress

from flows.run import IterationTable
from ppoflow.config import load_config
from storage.layout import layout_for


def _table(tmp_path, rows, already):
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=t", "run.iterations=3"])
    layout = layout_for(cfg)
    layout.fs.makedirs(layout.run_dir, exist_ok=True)
    with open(layout.metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = io.StringIO()
    progress = Progress(console=Console(file=out, width=120))
    task = progress.add_task("run t", total=3, completed=already)
    table = IterationTable(cfg, progress, task, already)
    table.poll()
    table.poll()  # a second poll prints nothing again
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    return lines, progress.tasks[0].completed


ROWS = [
    {"iteration": 0, "eval/reward_mean": 0.25, "eval/accuracy": 0.25},
    {"iteration": 1, "reward/mean": 0.5},
    {"iteration": 2, "reward/mean": 0.75, "eval/reward_mean": 0.5, "eval/accuracy": 0.5},
]


def test_a_fresh_start_prints_row_zero_and_counts_only_iterations(tmp_path):
    lines, completed = _table(tmp_path, ROWS, already=0)
    assert lines[0].split()[:4] == ["iter", "reward", "signal", "kl"]
    assert [line.split()[0] for line in lines[1:]] == ["0", "1", "2"]
    assert lines[1].split()[-4:-2] == ["0.250", "0.25"]  # eval, acc of the initial policy
    assert completed == 2  # iterations 1 and 2, not row 0


def test_a_resumed_start_prints_only_the_new_iterations(tmp_path):
    lines, completed = _table(tmp_path, ROWS, already=1)
    assert [line.split()[0] for line in lines[1:]] == ["2"]
    assert completed == 2


def test_the_signal_advice_is_printed_once(tmp_path):
    # 3 iterations (the defaults' signal.advice_after) at 1/16, 0, 1/8 of the groups with spread (< 0.25)
    rows = [
        {"iteration": i, "reward/mean": 0.0, "signal/group_spread": s} for i, s in ((1, 0.0625), (2, 0), (3, 0.125))
    ]
    lines, _ = _table(tmp_path, rows, already=0)
    advice = [line for line in lines if "little to learn from" in line]
    assert len(advice) == 1 and "0.06, 0.00, 0.12" in advice[0]  # two polls, one line
    quiet = [{**r, "signal/group_spread": 0.5} for r in rows]
    assert not [line for line in _table(tmp_path / "quiet", quiet, already=0)[0] if "little to learn" in line]


def test_a_promotion_is_said_under_its_row(tmp_path):
    rows = [
        {"iteration": 1, "reward/mean": 0.6, "curriculum/level": 0, "curriculum/next_level": 0},
        {
            "iteration": 2,
            "reward/mean": 0.7,
            "curriculum/level": 0,
            "curriculum/next_level": 1,
            "curriculum/reward_at_level": 0.703125,
        },
    ]
    lines, _ = _table(tmp_path, rows, already=0)
    assert lines[-1] == "curriculum: level 0 -> 1 from iteration 3 (reward at level 0: 0.703)"
    assert sum("curriculum:" in line for line in lines) == 1
