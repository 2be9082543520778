"""bench.curriculum_vs_baseline's figures from a run's metrics rows, against a hand count."""

from __future__ import annotations

from bench.curriculum_vs_baseline import run_figures, timeline

ROWS = [  # out of order on purpose; iteration 4 was rebuilt after a crash (no timing): left out
    {"iteration": 2, "timing/iteration": 50.0, "curriculum/level": 1, "eval/accuracy": 0.05},
    {"iteration": 0, "timing/eval": 100.0, "eval/accuracy": 0.01},
    {"iteration": 1, "timing/iteration": 40.0, "curriculum/level": 0},
    {"iteration": 3, "timing/iteration": 30.0, "curriculum/level": 1, "eval/accuracy": 0.2},
    {"iteration": 4, "curriculum/level": 1},
]


def test_the_timeline_adds_up_each_rows_seconds_in_iteration_order():
    # 100 (the initial eval), + 40, + 50, + 30
    assert [(r["iteration"], r["wall_s"]) for r in timeline(ROWS)] == [(0, 100.0), (1, 140.0), (2, 190.0), (3, 220.0)]


def test_run_figures_by_hand():
    figures = run_figures(timeline(ROWS))
    assert figures == {
        "accuracy_before": 0.01,
        "accuracy_after": 0.2,
        "gain_points": 19.0,  # 100 x (0.20 - 0.01)
        "wall_s": 220.0,
        "iterations": 3,
        "promotions": [[2, 1]],  # level 0 at iteration 1, 1 from iteration 2
    }


def test_the_timeline_stops_at_until():
    assert [r["iteration"] for r in timeline(ROWS, until=2)] == [0, 1, 2]
