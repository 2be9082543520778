"""DAPO's overlong penalty, the running reward normaliser and shape_scores: hand values and properties."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.ppo.reward_norm import RunningMoments
from engines.ppo.reward_shaping import shape_scores
from engines.ppo.rewards import overlong_penalty


class TestOverlongPenalty:
    def test_by_hand(self):
        # L_max 8, L_cache 4: free up to 4 tokens, then -(|y| - 4) / 4 * 1.0, -1 at 8 and beyond
        lengths = torch.tensor([3, 4, 5, 6, 8, 9])
        got = overlong_penalty(lengths, max_new_tokens=8, buffer=4, penalty=1.0)
        torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
        # penalty 0.5 halves it; buffer = max_new_tokens ramps from the first token
        torch.testing.assert_close(overlong_penalty(lengths[:3], 8, 4, 0.5), torch.tensor([0.0, 0.0, -0.125]))
        torch.testing.assert_close(overlong_penalty(torch.tensor([0, 2]), 2, 2, 1.0), torch.tensor([0.0, -1.0]))

    def test_errors(self):
        with pytest.raises(ValueError, match="reward.overlong.buffer must be in"):
            overlong_penalty(torch.tensor([1]), 8, 9, 1.0)
        with pytest.raises(ValueError, match="reward.overlong.penalty must be > 0"):
            overlong_penalty(torch.tensor([1]), 8, 4, 0.0)


class TestRunningMoments:
    def test_by_hand(self):
        m = RunningMoments()
        m.update(torch.tensor([1.0, 3.0]))
        assert (m.count, m.mean, m.var) == (2.0, 2.0, 1.0)
        m.update(torch.tensor([5.0]))
        # all of 1, 3, 5: mean 3, population variance (4 + 0 + 4) / 3
        assert (m.count, m.mean) == (3.0, 3.0) and m.var == pytest.approx(8 / 3)
        got = m.normalize(torch.tensor([3.0, 5.0]))
        torch.testing.assert_close(got, torch.tensor([0.0, 2.0 / (8 / 3) ** 0.5]))

    @settings(max_examples=30, deadline=None)
    @given(st.lists(st.lists(st.floats(-100, 100), min_size=1, max_size=6), min_size=1, max_size=5))
    def test_merging_batches_equals_the_moments_of_all(self, batches):
        m = RunningMoments()
        for b in batches:
            m.update(torch.tensor(b, dtype=torch.float64))
        everything = torch.tensor([x for b in batches for x in b], dtype=torch.float64)
        assert m.count == len(everything)
        assert m.mean == pytest.approx(float(everything.mean()), abs=1e-9)
        assert m.var == pytest.approx(float(everything.var(unbiased=False)), rel=1e-9, abs=1e-9)

    def test_state_survives_a_json_round_trip_and_continues_identically(self):
        a = RunningMoments()
        a.update(torch.tensor([0.5, -2.0, 4.0]))
        b = RunningMoments()
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as trainer.json stores it
        for m in (a, b):
            m.update(torch.tensor([1.0, 7.0]))
        assert a.state_dict() == b.state_dict()

    def test_errors(self):
        with pytest.raises(RuntimeError, match="before any update"):
            RunningMoments().normalize(torch.tensor([1.0]))
        with pytest.raises(ValueError, match="non-finite"):
            RunningMoments().update(torch.tensor([1.0, float("nan")]))
        with pytest.raises(ValueError, match=r"lacks \['m2'\]"):
            RunningMoments().load_state_dict({"count": 1, "mean": 0})


def test_shape_scores_normalises_then_penalises():
    # rewards 1, 3 (lengths 2 and 4 of max 4, buffer 2): normalised to -1, +1 (mean 2, std 1), then the
    # 4-token response loses the full penalty 0.5
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    scores, metrics = shape_scores(
        torch.tensor([1.0, 3.0]), mask, RunningMoments(), overlong=(2, 0.5), max_new_tokens=4
    )
    torch.testing.assert_close(scores, torch.tensor([-1.0, 0.5]), atol=1e-6, rtol=0)
    assert metrics == {"reward/running_mean": 2.0, "reward/running_std": 1.0, "reward/overlong_penalty_mean": -0.25}
    same, none = shape_scores(torch.tensor([1.0, 3.0]), mask)
    assert same.tolist() == [1.0, 3.0] and none == {}
