"""The signal shares (engines/ppo/signal.py), the one-line advice (flows/signal_advice.py) and the table column."""

from __future__ import annotations

import pytest
import torch

from engines.ppo.advantages import group_advantages
from engines.ppo.signal import signal_metrics
from flows.run import table_header, table_row
from flows.signal_advice import signal_advice, signal_share
from ppoflow.config import load_config


class TestSignalMetrics:
    def test_hand_derived_shares(self):
        # 3 groups of 2: (1, 0) differs, (0, 0) and (1, 1) do not -> group_spread 1/3.
        # Advantages: rows 0 and 1 nonzero on a trained token; row 2 zero; row 3 nonzero only on a masked token;
        # rows 4, 5 zero -> nonzero_advantage 2/6.
        scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
        advantages = torch.tensor([[0.7, 0.7], [-0.7, 0.0], [0.0, 0.0], [0.0, 0.5], [0.0, 0.0], [0.0, 0.0]])
        mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1]])
        got = signal_metrics(scores, [0, 0, 1, 1, 2, 2], advantages, mask)
        assert got == {"signal/group_spread": pytest.approx(1 / 3), "signal/nonzero_advantage": pytest.approx(2 / 6)}

    def test_agrees_with_grpo_advantages(self):
        # Property: under GRPO (no KL in the reward) a sample's advantage is non-zero exactly when its group has
        # spread, so nonzero_advantage = (samples in groups with spread) / samples. Groups: [1,0,0,0] spread,
        # [0,0,0,0] flat, [.5,.5,1,.5] spread -> 2/3 of the groups, 8/12 of the samples.
        scores = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 1.0, 0.5])
        per_sample = group_advantages(scores, 4, "grpo").float()
        advantages = per_sample[:, None].expand(12, 3).clone()
        got = signal_metrics(scores, [i // 4 for i in range(12)], advantages, torch.ones(12, 3))
        assert got["signal/group_spread"] == pytest.approx(2 / 3)
        assert got["signal/nonzero_advantage"] == pytest.approx(8 / 12)

    def test_single_sample_groups_have_no_spread_key(self):
        got = signal_metrics(torch.tensor([1.0, 0.0]), [0, 1], torch.ones(2, 1), torch.ones(2, 1))
        assert "signal/group_spread" not in got and got["signal/nonzero_advantage"] == 1.0

    def test_mismatched_lengths_name_them(self):
        with pytest.raises(ValueError, match="3 group ids"):
            signal_metrics(torch.zeros(2), [0, 0, 1], torch.zeros(2, 1), torch.zeros(2, 1))


def _cfg(*overrides: str):
    return load_config(None, ["rollout.n_samples=4", *overrides])


class TestAdvice:
    def rows(self, *shares):
        return [{"iteration": i + 1, "signal/group_spread": s} for i, s in enumerate(shares)]

    def test_said_after_the_last_n_all_below(self):
        # defaults: below 0.25 for 3 iterations in a row; iterations 2-4 are 0.125, 0.0625, 0.0 (1/8, 1/16, 0 of 16)
        rows = [{"iteration": 0, "eval/accuracy": 0.035, "eval/sampled_pass@4": 0.12}]
        rows += self.rows(0.5, 0.125, 0.0625, 0.0)
        line = signal_advice(rows, _cfg())
        assert line is not None and "\n" not in line
        assert "iterations 2-4 only 0.12, 0.06, 0.00" in line and "signal.advice_below=0.25" in line
        assert "greedy accuracy 0.035" in line and "sampled_pass@4 0.120" in line
        hints = ("rollout.dynamic_sampling.enabled=true", "rollout.n_samples=8, now 4", "data.reasoning_gym.curriculum")
        for hint in hints:
            assert hint in line

    def test_not_said_when_one_is_at_the_threshold_or_too_few_rows(self):
        assert signal_advice(self.rows(0.1, 0.25, 0.1), _cfg()) is None  # 0.25 is not below 0.25
        assert signal_advice(self.rows(0.1, 0.1), _cfg()) is None  # 2 of the 3 iterations
        assert signal_advice(self.rows(0.1, 0.1, 0.1), _cfg("signal.advice_below=0")) is None  # switched off
        unmeasured = self.rows(0.1, 0.1) + [{"iteration": 3}]  # a rebuilt row without the key breaks the run
        assert signal_advice(unmeasured, _cfg()) is None

    def test_a_curriculum_above_its_start_is_told_about_its_step(self):
        # the real recipe's run: level 0 -> 1 at iteration 4, then 0.19, 0.00, 0.12 of the groups with spread
        cfg = _cfg("data.reasoning_gym.task=basic_arithmetic", 'data.reasoning_gym.curriculum={"target_level": 3}')
        rows = [
            {"iteration": i, "signal/group_spread": s, "curriculum/level": 1} for i, s in ((4, 0.19), (5, 0), (6, 0.12))
        ]
        line = signal_advice(rows, cfg)
        assert "a smaller step to curriculum level 1" in line and "range_mode: inclusive" in line
        assert "a curriculum (data.reasoning_gym.curriculum)" not in line  # it has one
        at_start = [{**r, "curriculum/level": 0} for r in rows]
        assert "a smaller step" not in signal_advice(at_start, cfg)

    def test_dynamic_sampling_uses_the_sampled_share(self):
        # kept groups all differ (group_spread 1.0), but 15 of 16 sampled groups were flat: share 1/16
        row = {"signal/group_spread": 1.0, "rollout/zero_variance_sampled_fraction": 15 / 16}
        assert signal_share(row) == pytest.approx(1 / 16)
        rows = [{"iteration": i, **row} for i in (1, 2, 3)]
        line = signal_advice(rows, _cfg("rollout.dynamic_sampling.enabled=true"))
        assert line is not None and "dynamic_sampling.enabled=true" not in line and "0.06, 0.06, 0.06" in line


def test_the_table_shows_the_share():
    header, row = table_header(), table_row({"iteration": 3, "signal/group_spread": 0.1875})
    assert "signal" in header.split()
    column = header.split().index("signal")
    assert row.split()[column] == "0.19"


def test_sampled_eval_metrics_by_hand():
    import pyarrow as pa

    from stages.evaluate_sampled import sampled_due, sampled_metrics

    # 3 held-out prompts x 4 samples: A [1,0,0,0], B [0,0,0,0], C [1,1,1,1]. accuracy 5/12; pass@4: A 1, B 0, C 1
    # -> 2/3; spread: only A's rewards differ -> 1/3.
    rewards = [1.0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    got = sampled_metrics(pa.table({"reward": pa.array(rewards, pa.float32())}), 4)
    assert got == {
        "eval/sampled_reward_mean": pytest.approx(5 / 12),
        "eval/sampled_accuracy": pytest.approx(5 / 12),
        "eval/sampled_pass@4": pytest.approx(2 / 3),
        "eval/sampled_spread": pytest.approx(1 / 3),
    }
    # partial credit (reasoning-gym's 0.01 for a wrong number): 1.0 still counts as correct for pass@k.
    # Prompts [1, .01] and [.01, .01]: pass@2 = (1 + 0) / 2; the second prompt's rewards are equal: spread 1/2.
    partial = sampled_metrics(pa.table({"reward": pa.array([1.0, 0.01, 0.01, 0.01], pa.float32())}), 2)
    assert partial["eval/sampled_pass@2"] == 0.5 and partial["eval/sampled_accuracy"] == 0.25
    assert partial["eval/sampled_spread"] == 0.5
    assert sampled_due(_cfg(), 0) and not sampled_due(_cfg(), 3)  # default: the initial eval only
    assert sampled_due(_cfg("eval.sampled_pass_at_k=every"), 3)
    assert not sampled_due(_cfg("eval.sampled_pass_at_k=never"), 0)
