"""bench.async's figures from hand-made driver output (the module name is a keyword: imported by name)."""

import importlib

import pytest

bench_async = importlib.import_module("bench.async")


def _run(k, ends, rewards, t0=100.0):
    rows = [
        {"iteration": i + 1, "reward/mean": r, "time/finished_unix": e, "async/staleness": min(k, i)}
        for i, (e, r) in enumerate(zip(ends, rewards))
    ]
    bodies = {s: [1.0] * len(ends) for s in bench_async.STAGES}
    return {"driver": "warm", "k": k, "rows": rows, "bodies": bodies, "t0": t0}


def test_figures_by_hand():
    # k = 0: iterations end at +10, +14, +18, +22 -> 3 iterations in 12 s = 0.25 it/s, total 22 s
    # k = 1: +10, +12, +14, +16 -> 3 in 6 s = 0.5 it/s (speedup 2.0), total 16 s (total speedup 22/16 = 1.375)
    # equal time = 16 s: k = 0 had finished iterations 1-2 (rewards 0.1, 0.2 -> mean 0.15);
    # k = 1 all four: the last three 0.2, 0.3, 0.4 -> 0.3
    k0 = _run(0, [110, 114, 118, 122], [0.1, 0.2, 0.3, 0.4])
    k1 = _run(1, [110, 112, 114, 116], [0.1, 0.2, 0.3, 0.4])
    out = bench_async.summarize("warm", {0: [k0], 1: [k1]})
    assert out["k0"]["it_per_s"] == 0.25 and out["k1"]["it_per_s"] == 0.5
    assert out["k1"]["speedup"] == 2.0 and out["k1"]["total_speedup"] == 1.375
    assert out["equal_time_s"] == 16.0
    assert out["k0"]["reward_at_equal_time"] == pytest.approx(0.15)
    assert out["k1"]["reward_at_equal_time"] == pytest.approx(0.3)
    assert out["k0"]["staleness_ok"] and out["k1"]["staleness_ok"]


def test_a_row_staler_than_k_is_flagged():
    run = _run(1, [110, 112, 114], [0.1, 0.2, 0.3])
    run["rows"][2]["async/staleness"] = 2  # iteration 3 with k = 1 may be 1 version old, not 2
    assert not bench_async.figures_of(run)["staleness_ok"]
    assert bench_async.reward_by([(5.0, 0.5)], 4.0) is None


def test_reward_at_equal_time_per_seed_then_median():
    # Two repeats (seeds). Seed 0: as in test_figures_by_hand, T = 16 s: k = 0 0.15, k = 1 0.3.
    # Seed 1: k = 0 ends at +10, +12, +14, +16 and k = 1 at +10, +11, +12, +13, so T = 13 s: k = 0 has iterations
    # 1-2 (0.5, 0.6 -> 0.55); k = 1 all four, the last three 0.2, 0.1, 0.0 -> 0.1.
    k0 = [_run(0, [110, 114, 118, 122], [0.1, 0.2, 0.3, 0.4]), _run(0, [110, 112, 114, 116], [0.5, 0.6, 0.7, 0.8])]
    k1 = [_run(1, [110, 112, 114, 116], [0.1, 0.2, 0.3, 0.4]), _run(1, [110, 111, 112, 113], [0.3, 0.2, 0.1, 0.0])]
    out = bench_async.summarize("warm", {0: k0, 1: k1})
    assert out["k0"]["reward_at_equal_time_by_seed"] == [0.15, 0.55]
    assert out["k1"]["reward_at_equal_time_by_seed"] == [0.3, 0.1]
    assert out["k0"]["reward_at_equal_time"] == pytest.approx(0.35)  # median of two: their mean
    assert out["k1"]["reward_at_equal_time"] == pytest.approx(0.2)
    assert out["equal_time_s"] == 14.5  # median of 16 and 13
