"""DAPO dynamic sampling (engines/ppo/dynamic_sampling.py) and eval metrics (engines/evaluation.py), by hand."""

import math

import pytest

from engines.evaluation import eval_metrics, pass_at_k
from engines.ppo.dynamic_sampling import (
    SampledGroup,
    extra_prompt_rows,
    has_reward_variance,
    prompts_to_draw,
    select_groups,
)


def _g(row, rnd, *rewards):
    return SampledGroup(row, rnd, tuple(float(r) for r in rewards))


class TestSelectGroups:
    # round 0: rows 10 (flat 1s), 11 (varied), 12 (flat 0s), 13 (varied); round 1: 20 (varied), 21 (flat)
    groups = [_g(10, 0, 1, 1), _g(11, 0, 0, 1), _g(12, 0, 0, 0), _g(13, 0, 1, 0), _g(20, 1, 0.5, 0.2), _g(21, 1, 0, 0)]

    def test_full_batch_drops_flat_groups(self):
        sel = select_groups(self.groups, target_groups=3, groups_per_step=1)
        assert [g.prompt_row for g in sel.groups] == [11, 13, 20]
        assert sel.metrics == {
            "rollout/dynamic_rounds": 2.0,
            "rollout/groups_kept": 3.0,
            "rollout/groups_dropped": 3.0,  # 10, 12, 21 (flat)
            "rollout/batch_filled": 1.0,
            "rollout/zero_variance_sampled_fraction": 3 / 6,
            "rollout/zero_variance_trained_fraction": 0.0,
        }

    def test_rounds_ran_out_trains_on_whole_steps(self):
        # 3 varied groups for a target of 4 in steps of 2 groups: one step of 2 (11, 13)
        sel = select_groups(self.groups, target_groups=4, groups_per_step=2)
        assert [g.prompt_row for g in sel.groups] == [11, 13]
        assert sel.metrics["rollout/batch_filled"] == 0.0
        assert sel.metrics["rollout/groups_dropped"] == 4.0  # 6 sampled - 2 kept (20 varied but past the step)

    def test_not_one_step_with_variance_tops_up_with_flat_groups_in_draw_order(self):
        # steps of 2 groups; only row 2 varies: the step is row 1 (flat, drawn first) and row 2, in draw order
        sel = select_groups([_g(1, 0, 1, 1), _g(2, 0, 0, 1), _g(3, 1, 0, 0)], target_groups=2, groups_per_step=2)
        assert [g.prompt_row for g in sel.groups] == [1, 2]
        assert sel.metrics["rollout/zero_variance_trained_fraction"] == 0.5
        assert sel.metrics["rollout/batch_filled"] == 0.0
        flat = select_groups([_g(1, 0, 1, 1), _g(3, 1, 0, 0)], 2, 2)
        assert [g.prompt_row for g in flat.groups] == [1, 3] and flat.metrics["rollout/batch_filled"] == 0.0

    def test_disabled_trains_round_zero_and_measures_flat_groups(self):
        sel = select_groups(self.groups, target_groups=4, groups_per_step=2, enabled=False)
        assert [g.prompt_row for g in sel.groups] == [10, 11, 12, 13]
        assert sel.metrics["rollout/zero_variance_trained_fraction"] == 0.5

    def test_order_is_by_round_then_draw_order(self):
        shuffled = [self.groups[4], self.groups[1], self.groups[3]]  # round 1 listed first
        assert [g.prompt_row for g in select_groups(shuffled, 3, 3).groups] == [11, 13, 20]

    def test_equal_rewards_with_different_overlong_penalties_are_kept(self):
        # rewards (1, 1) everywhere; penalties (0, -0.5) differ (a signal: shorter is better), (-0.5, -0.5) do not
        groups = [SampledGroup(1, 0, (1.0, 1.0), (-0.5, -0.5)), SampledGroup(2, 0, (1.0, 1.0), (0.0, -0.5))]
        sel = select_groups(groups, target_groups=1, groups_per_step=1)
        assert [g.prompt_row for g in sel.groups] == [2]
        assert sel.metrics["rollout/zero_variance_sampled_fraction"] == 0.5

    def test_errors(self):
        with pytest.raises(ValueError, match="target_groups=3 must be a positive multiple of groups_per_step=2"):
            select_groups(self.groups, 3, 2)
        with pytest.raises(ValueError, match="non-finite"):
            has_reward_variance([0.0, math.nan])


class TestDraws:
    def test_extra_rows_are_fixed_by_seed_iteration_round_and_avoid_drawn_rows(self):
        first = extra_prompt_rows(20, seed=7, iteration=3, round_index=1, count=5, exclude={0, 1, 2})
        assert first == extra_prompt_rows(20, 7, 3, 1, 5, exclude=[2, 1, 0])  # a retry draws the same
        assert len(set(first)) == 5 and not set(first) & {0, 1, 2} and all(0 <= r < 20 for r in first)
        assert first != extra_prompt_rows(20, 7, 3, 2, 5, exclude={0, 1, 2})  # another round, other rows
        assert first != extra_prompt_rows(20, 8, 3, 1, 5, exclude={0, 1, 2})  # another seed
        assert sorted(extra_prompt_rows(4, 0, 0, 1, 10, exclude={1})) == [0, 2, 3]  # only 3 left
        with pytest.raises(ValueError, match="round_index >= 1"):
            extra_prompt_rows(4, 0, 0, 0, 1)

    @pytest.mark.parametrize(
        "target, kept, sampled, expected",
        [
            (8, 8, 10, 0),  # full
            (8, 4, 8, 8),  # half kept -> twice the shortfall of 4
            (8, 6, 8, 3),  # 3/4 kept -> ceil(2 * 8 / 6) = 3
            (8, 1, 8, 28),  # 1/8 kept -> 56, capped at 4 x 7
            (8, 0, 0, 8),  # nothing sampled yet: the shortfall
            (8, 0, 8, 32),  # nothing kept: 4 x the shortfall
        ],
    )
    def test_prompts_to_draw(self, target, kept, sampled, expected):
        assert prompts_to_draw(target, kept, sampled) == expected


class TestEval:
    @pytest.mark.parametrize(
        "n, c, k, expected",
        [
            (5, 2, 1, 2 / 5),  # pass@1 = c / n
            (5, 2, 2, 1 - 3 / 10),  # 1 - C(3, 2) / C(5, 2)
            (5, 0, 3, 0.0),
            (5, 3, 3, 1.0),  # n - c = 2 < k: every 3-subset has a correct one
            (4, 1, 4, 1.0),
        ],
    )
    def test_pass_at_k_by_hand(self, n, c, k, expected):
        assert pass_at_k(n, c, k) == pytest.approx(expected)

    def test_pass_at_k_equals_the_binomial_form(self):
        for n in range(1, 9):
            for c in range(n + 1):
                for k in range(1, n + 1):
                    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))

    def test_eval_metrics(self):
        # prompts: [1, 0, 0, 0] (c=1), [1, 1, 0, 0] (c=2); pass@2 = ((1 - 3/6) + (1 - 1/6)) / 2 = 2/3
        got = eval_metrics([1, 0, 0, 0, 1, 1, 0, 0], group_size=4, ks=(1, 2))
        expected = {"eval/reward_mean": 3 / 8, "eval/accuracy": 3 / 8, "eval/pass@1": 3 / 8, "eval/pass@2": 2 / 3}
        assert got == pytest.approx(expected)
        # partial credit (a reasoning-gym scorer's 0.5): no pass@k, accuracy counts only the 1.0 of the four
        got = eval_metrics([0.5, 1.0, 0.25, 0.0], group_size=2, ks=(1,))
        assert got == pytest.approx({"eval/reward_mean": 1.75 / 4, "eval/accuracy": 1 / 4})
        assert eval_metrics([2.5, -1.0], group_size=2, ks=(1,)) == {"eval/reward_mean": 0.75}  # not a [0, 1] score
        with pytest.raises(ValueError, match=r"k \[3\] outside"):
            eval_metrics([1, 0], 2, ks=(3,))
        with pytest.raises(ValueError, match="3 rewards is not a non-empty multiple of group_size=2"):
            eval_metrics([1, 0, 1], 2)
