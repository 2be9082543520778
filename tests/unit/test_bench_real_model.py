"""bench/real_model.py's pure helpers: the update's FLOP count, stage seconds first/steady, accuracy before/after."""

import pytest

from bench.real_model import accuracy_figures, stage_seconds, update_flops


class TestUpdateFlops:
    def test_one_epoch_is_six_flops_per_parameter_and_token(self):
        # 10 params x 7 tokens x (6 per epoch x 1 epoch) = 420
        assert update_flops(10, 7, 1, old_logprobs_forward=False) == 420

    def test_a_separate_old_logprob_forward_adds_a_forward(self):
        # 10 x 7 x (6 x 2 epochs + 2 for the forward) = 70 x 14 = 980
        assert update_flops(10, 7, 2, old_logprobs_forward=True) == 980


class TestStageSeconds:
    def test_first_iteration_alone_and_the_median_of_the_rest(self):
        rows = [
            {"iteration": 0, "timing/eval": 9.0},  # eval before training: not an iteration
            {"iteration": 2, "timing/rollout": 4.0, "timing/iteration": 10.0},
            {"iteration": 1, "timing/rollout": 50.0, "timing/iteration": 90.0, "reward/mean": 0.1},
            {"iteration": 3, "timing/rollout": 6.0, "timing/iteration": 14.0},
            {"iteration": 4, "timing/rollout": 5.0, "timing/iteration": 11.0},
        ]
        first, steady = stage_seconds(rows)
        assert first == {"timing/rollout": 50.0, "timing/iteration": 90.0}
        # iterations 2-4: rollout 4, 6, 5 -> 5; iteration 10, 14, 11 -> 11
        assert steady == {"timing/rollout": 5.0, "timing/iteration": 11.0}

    def test_one_iteration_has_no_steady_state(self):
        assert stage_seconds([{"iteration": 1, "timing/update": 3.0}]) == ({"timing/update": 3.0}, {})


class TestAccuracyFigures:
    def test_row_zero_against_the_last_row_that_holds_it(self):
        rows = [
            {"iteration": 0, "eval/accuracy": 0.04},
            {"iteration": 5, "eval/accuracy": 0.2},
            {"iteration": 6},
            {"iteration": 10, "eval/accuracy": 0.5},
            {"iteration": 11},
        ]
        got = accuracy_figures(rows)
        assert got["accuracy_before"] == 0.04 and got["accuracy_after"] == 0.5
        assert got["accuracy_after_iteration"] == 10
        assert got["accuracy_gain"] == pytest.approx(0.46)
        assert got["accuracy_after_over_before"] == 12.5  # 0.5 / 0.04

    def test_a_run_without_eval_rows_gives_no_figures(self):
        assert accuracy_figures([{"iteration": 1}, {"iteration": 2}]) == {}

    def test_zero_before_gives_the_gain_but_no_ratio(self):
        got = accuracy_figures([{"iteration": 0, "eval/accuracy": 0.0}, {"iteration": 3, "eval/accuracy": 0.1}])
        assert got["accuracy_gain"] == 0.1 and "accuracy_after_over_before" not in got
