"""token_level_rewards: hand-worked rows, clipping, empty responses, and a conservation property."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.ppo.rewards import clip_scores, last_response_index, token_level_rewards


class TestTokenLevelRewards:
    def test_hand_example(self):
        # beta = 0.1, kl = 0.5 everywhere -> -0.05 per response token; score added at the last one:
        # row 0: 3 tokens, score 1 -> [-0.05, -0.05, 1 - 0.05, 0]; row 1: 2 tokens, score 2.
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
        rewards = token_level_rewards(torch.tensor([1.0, 2.0]), torch.full((2, 4), 0.5), mask, 0.1, 10.0)
        expected = torch.tensor([[-0.05, -0.05, 0.95, 0.0], [-0.05, 1.95, 0.0, 0.0]])
        torch.testing.assert_close(rewards, expected)

    def test_score_clipped(self):
        mask = torch.ones(2, 2)
        rewards = token_level_rewards(torch.tensor([15.0, -15.0]), torch.zeros(2, 2), mask, 0.1, 10.0)
        torch.testing.assert_close(rewards, torch.tensor([[0.0, 10.0], [0.0, -10.0]]))
        unclipped = token_level_rewards(torch.tensor([15.0, -15.0]), torch.zeros(2, 2), mask, 0.1, None)
        torch.testing.assert_close(unclipped[:, -1], torch.tensor([15.0, -15.0]))

    def test_empty_response_gets_nothing_and_padding_does_not_leak(self):
        mask = torch.tensor([[0, 0, 0], [1, 0, 0]])
        kl = torch.tensor([[1.0, 1.0, 1.0], [0.2, math.nan, math.inf]])  # garbage at padding
        rewards = token_level_rewards(torch.tensor([5.0, 3.0]), kl, mask, 0.5)
        # row 1: one token: -0.5 * 0.2 + 3 = 2.9
        torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 0.0], [2.9, 0.0, 0.0]]))

    def test_response_after_prompt_positions(self):
        # a window that also holds prompt positions (mask 0 before the response): last index is 2
        last, has = last_response_index(torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]]))
        assert last.tolist()[0] == 2 and has.tolist() == [True, False]

    @settings(max_examples=50, deadline=None)
    @given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.floats(0, 1), st.integers(0, 2**31 - 1))
    def test_row_sum_is_clipped_score_minus_kl(self, lengths, kl_coef, seed):
        # sum_t r_t = clip(score) * 1[len > 0] - beta * sum over response tokens of kl
        generator = torch.Generator().manual_seed(seed)
        mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).long()
        kl = torch.randn(len(lengths), 6, generator=generator, dtype=torch.float64)
        scores = 8 * torch.randn(len(lengths), generator=generator, dtype=torch.float64)
        rewards = token_level_rewards(scores, kl, mask, kl_coef, 5.0)
        expected = scores.clamp(-5, 5) * (mask.sum(-1) > 0) - kl_coef * (kl * mask).sum(-1)
        torch.testing.assert_close(rewards.sum(-1), expected)
        assert torch.all(rewards[mask == 0] == 0)

    def test_errors(self):
        mask = torch.ones(2, 3)
        with pytest.raises(ValueError, match=r"scores must have shape \(B,\)"):
            token_level_rewards(torch.zeros(2, 1), torch.zeros(2, 3), mask, 0.1)
        with pytest.raises(ValueError, match="scores has 3 rows but kl has 2"):
            token_level_rewards(torch.zeros(3), torch.zeros(2, 3), mask, 0.1)
        with pytest.raises(ValueError, match="kl_coef must be >= 0"):
            token_level_rewards(torch.zeros(2), torch.zeros(2, 3), mask, -0.1)
        with pytest.raises(ValueError, match="reward_clip must be > 0"):
            clip_scores(torch.zeros(2), 0.0)
