"""GAE, discounted returns, whitening, group estimators and the compute_advantages dispatcher."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.ppo.advantages import compute_advantages, discounted_returns, gae, group_advantages, masked_whiten
from engines.ppo.rewards import token_level_rewards

seeds = st.integers(0, 2**31 - 1)


def right_padded_mask(lengths, width):
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


class TestGae:
    def test_three_tokens_by_hand(self):
        # gamma = 0.9, lam = 0.8, r = [0, 0, 1], V = [0.5, 0.6, 0.7], then a pad with garbage (99, 5):
        # d2 = 1 + 0.9*0 - 0.7 = 0.3                A2 = 0.3
        # d1 = 0 + 0.9*0.7 - 0.6 = 0.03             A1 = 0.03 + 0.72*0.3 = 0.246
        # d0 = 0 + 0.9*0.6 - 0.5 = 0.04             A0 = 0.04 + 0.72*0.246 = 0.21712
        # returns = A + V = [0.71712, 0.846, 1.0]
        rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
        values = torch.tensor([[0.5, 0.6, 0.7, 99.0]])
        mask = torch.tensor([[1, 1, 1, 0]])
        advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
        torch.testing.assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]))
        torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]))

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.integers(0, 7), min_size=1, max_size=4), seeds)
    def test_gamma_lambda_one_is_monte_carlo_return_minus_value(self, lengths, seed):
        # with gamma = lam = 1: A_t = sum_{t' >= t} r_t' - V_t (telescoping), computed by a reverse cumsum
        generator = torch.Generator().manual_seed(seed)
        mask = right_padded_mask(lengths, 7)
        rewards = torch.randn(len(lengths), 7, generator=generator, dtype=torch.float64) * mask
        values = torch.randn(len(lengths), 7, generator=generator, dtype=torch.float64)
        advantages, returns = gae(rewards, values, mask, 1.0, 1.0)
        monte_carlo = rewards.flip(-1).cumsum(-1).flip(-1)
        torch.testing.assert_close(advantages.double(), ((monte_carlo - values) * mask), atol=1e-5, rtol=0)
        torch.testing.assert_close(returns.double(), monte_carlo * mask, atol=1e-5, rtol=0)

    def test_lambda_zero_is_one_step_td(self):
        # lam = 0: A_t = delta_t = r_t + gamma V_{t+1} - V_t; last token: r - V
        rewards, values = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.25]])
        advantages, _ = gae(rewards, values, torch.ones(1, 2), gamma=0.5, lam=0.0)
        torch.testing.assert_close(advantages, torch.tensor([[1.0 + 0.125 - 0.5, 2.0 - 0.25]]))

    def test_bad_discount(self):
        x = torch.zeros(1, 2)
        with pytest.raises(ValueError, match="gamma must be in"):
            gae(x, x, x, gamma=1.5, lam=1.0)
        with pytest.raises(ValueError, match="values has shape"):
            gae(x, torch.zeros(1, 3), x, 1.0, 1.0)


class TestDiscountedReturns:
    def test_by_hand(self):
        # gamma 0.5, r = [1, 2, 3]: G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75; pad -> 0
        got = discounted_returns(torch.tensor([[1.0, 2.0, 3.0, 7.0]]), torch.tensor([[1, 1, 1, 0]]), 0.5)
        torch.testing.assert_close(got, torch.tensor([[2.75, 3.5, 3.0, 0.0]]))


class TestMaskedWhiten:
    def test_by_hand(self):
        # [1, 2, 3] (pad 100 ignored): mean 2, population var 2/3 -> [-sqrt(1.5), 0, sqrt(1.5), 0]
        got = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
        torch.testing.assert_close(got, torch.tensor([[-(1.5**0.5), 0.0, 1.5**0.5, 0.0]]))

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.integers(1, 6), min_size=1, max_size=4), seeds, st.booleans())
    def test_masked_mean_zero_std_one(self, lengths, seed, shift_mean):
        generator = torch.Generator().manual_seed(seed)
        mask = right_padded_mask(lengths, 6)
        x = 3 + 5 * torch.randn(len(lengths), 6, generator=generator, dtype=torch.float64)
        if int(mask.sum()) < 2 or x[mask == 1].std() < 1e-3:
            return  # one token (or equal ones) has no spread to normalise
        kept = masked_whiten(x, mask, shift_mean=shift_mean)[mask == 1]
        target_mean = 0.0 if shift_mean else x[mask == 1].mean().item()
        assert kept.mean().item() == pytest.approx(target_mean, abs=1e-9)
        # population std is 1 up to eps = 1e-8 in the variance: exactly sqrt(var / (var + eps)), var computed here
        # by numpy (a bound of "1 within 1e-6" fails for close pairs: lengths [2], var 5e-4 gives 0.99999)
        var = float(np.var(x[mask == 1].numpy()))
        assert kept.std(unbiased=False).item() == pytest.approx((var / (var + 1e-8)) ** 0.5, rel=1e-9)

    def test_empty_mask_raises(self):
        with pytest.raises(ValueError, match="no position"):
            masked_whiten(torch.ones(2, 2), torch.zeros(2, 2))


class TestGroupAdvantages:
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 5.0])

    @pytest.mark.parametrize(
        "estimator, expected",
        [
            # group 1: mean 0.25, deviations [.75, -.25, -.25, -.25], unbiased var 0.75/3 = 0.25, std 0.5
            # group 2: mean 2.75, deviations [-.75, -.75, -.75, 2.25], unbiased var 6.75/3 = 2.25, std 1.5
            ("grpo", [1.5, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5, 1.5]),
            ("dr_grpo", [0.75, -0.25, -0.25, -0.25, -0.75, -0.75, -0.75, 2.25]),
            ("reinforce_pp_baseline", [0.75, -0.25, -0.25, -0.25, -0.75, -0.75, -0.75, 2.25]),
            # leave-one-out: 1 - 0 = 1, 0 - 1/3; 2 - (2 + 2 + 5)/3 = -1, 5 - 2 = 3
            ("rloo", [1.0, -1 / 3, -1 / 3, -1 / 3, -1.0, -1.0, -1.0, 3.0]),
        ],
    )
    def test_by_hand(self, estimator, expected):
        got = group_advantages(self.scores, 4, estimator)
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=0)  # eps 1e-6 in the std

    def test_equal_scores_give_zero_not_nan(self):
        assert torch.equal(group_advantages(torch.ones(4), 2, "grpo"), torch.zeros(4))

    @pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
    @pytest.mark.parametrize("group_size", [2, 4, 8])
    @pytest.mark.parametrize("value", [0.7, 3.3, 9.9, 1e6 + 0.1])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_flat_group_is_exactly_zero_for_inexact_values(self, estimator, group_size, value, dtype):
        # none of these values is exact in binary; every score equals the group's mean, so each deviation
        # (and the leave-one-out difference) is 0 by definition, and grpo's 0 / (0 + eps) is 0 too
        scores = torch.full((group_size,), value, dtype=dtype)
        assert torch.equal(group_advantages(scores, group_size, estimator), torch.zeros(group_size))

    @settings(max_examples=80, deadline=None)
    @given(
        st.integers(2, 8),
        st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=4),
        seeds,
        st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]),
    )
    def test_flat_groups_are_exactly_zero_beside_varied_ones(self, group_size, flat_values, seed, estimator):
        # each flat group is one arbitrary value repeated G times; a varied group (random scores) sits after each
        generator = torch.Generator().manual_seed(seed)
        groups = []
        for value in flat_values:
            groups += [torch.full((group_size,), value), torch.randn(group_size, generator=generator)]
        advantages = group_advantages(torch.cat(groups), group_size, estimator).view(-1, group_size)
        assert torch.equal(advantages[0::2], torch.zeros(len(flat_values), group_size))
        assert bool((advantages[1::2] != 0).any(dim=-1).all())  # distinct random scores keep their signal

    @settings(max_examples=40, deadline=None)
    @given(st.integers(2, 5), st.integers(1, 4), seeds, st.sampled_from(["grpo", "dr_grpo", "rloo"]))
    def test_sum_to_zero_within_each_group(self, group_size, groups, seed, estimator):
        generator = torch.Generator().manual_seed(seed)
        scores = torch.randn(group_size * groups, generator=generator)
        sums = group_advantages(scores, group_size, estimator).view(groups, group_size).sum(-1)
        torch.testing.assert_close(sums, torch.zeros(groups), atol=1e-5, rtol=0)

    def test_errors(self):
        with pytest.raises(ValueError, match="not a multiple of group_size=4"):
            group_advantages(torch.zeros(6), 4, "grpo")
        with pytest.raises(ValueError, match="group_size must be an int >= 2"):
            group_advantages(torch.zeros(6), 1, "rloo")
        with pytest.raises(ValueError, match="estimator must be one of"):
            group_advantages(torch.zeros(6), 2, "ppo")


class TestComputeAdvantages:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])

    def test_ppo_is_gae_then_whiten(self):
        rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
        values = torch.tensor([[0.5, 0.6, 0.7, 0.0], [0.1, 0.2, 0.0, 0.0]])
        common = dict(
            scores=torch.zeros(2), token_rewards=rewards, response_mask=self.mask, values=values, gamma=0.9, lam=0.8
        )
        raw = compute_advantages("ppo", whiten=False, **common)
        # row 0 is the hand example of TestGae; row 1: A1 = 2 - 0.2 = 1.8, A0 = 0.9*0.2 - 0.1 + 0.72*1.8
        torch.testing.assert_close(raw.advantages[1, :2], torch.tensor([0.08 + 1.296, 1.8]))
        whitened = compute_advantages("ppo", whiten=True, **common)
        torch.testing.assert_close(whitened.returns, raw.returns)  # value targets from raw advantages
        torch.testing.assert_close(whitened.advantages, masked_whiten(raw.advantages, self.mask))

    def test_ppo_needs_values(self):
        with pytest.raises(ValueError, match="needs values"):
            compute_advantages("ppo", scores=torch.zeros(2), token_rewards=torch.zeros(2, 4), response_mask=self.mask)

    def test_grpo_kl_in_loss_broadcasts_group_advantage(self):
        scores = torch.tensor([1.0, 0.0])
        rewards = token_level_rewards(scores, torch.ones(2, 4), self.mask, kl_coef=0.0)
        out = compute_advantages("grpo", scores=scores, token_rewards=rewards, response_mask=self.mask, group_size=2)
        # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.70711 = +-0.70711
        a = 0.5 / 0.5**0.5
        expected = torch.tensor([[a, a, a, 0.0], [-a, -a, 0.0, 0.0]])
        torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.returns, out.advantages)

    def test_rloo_kl_in_reward_adds_kl_to_go(self):
        # beta * kl = 0.1 per token; gamma = 1 -> KL-to-go row 0: [-0.3, -0.2, -0.1], row 1: [-0.2, -0.1]
        # scores 20 and 0 clipped at 10: rloo -> +10, -10. reward_clip makes the KL part exact.
        scores = torch.tensor([20.0, 0.0])
        rewards = token_level_rewards(scores, torch.ones(2, 4), self.mask, 0.1, reward_clip=10.0)
        out = compute_advantages(
            "rloo", scores=scores, token_rewards=rewards, response_mask=self.mask, group_size=2, reward_clip=10.0
        )
        expected = torch.tensor([[9.7, 9.8, 9.9, 0.0], [-10.2, -10.1, 0.0, 0.0]])
        torch.testing.assert_close(out.advantages, expected)

    def test_reinforce_pp_whitens_discounted_returns(self):
        rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 3.0, 0.0, 0.0]])
        out = compute_advantages(
            "reinforce_pp", scores=torch.zeros(2), token_rewards=rewards, response_mask=self.mask, gamma=1.0
        )
        # returns to go: [1, 1, 1] and [3, 3]: mean 1.8, population std sqrt(0.96) = 0.9798
        torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1, 1, 0], [3, 3, 0, 0]]))
        z_low, z_high = (1 - 1.8) / 0.96**0.5, (3 - 1.8) / 0.96**0.5
        expected = torch.tensor([[z_low, z_low, z_low, 0], [z_high, z_high, 0, 0]])
        torch.testing.assert_close(out.advantages, expected)

    def test_reinforce_pp_baseline(self):
        # scores [1, 3], one group: baseline 2 -> shaped [-1, +1] at the last token, no KL; gamma 1
        # -> returns [-1, -1, -1] and [1, 1]; whitening: mean -0.2, var 0.96
        scores = torch.tensor([1.0, 3.0])
        rewards = token_level_rewards(scores, torch.zeros(2, 4), self.mask, 0.1)
        out = compute_advantages(
            "reinforce_pp_baseline", scores=scores, token_rewards=rewards, response_mask=self.mask, group_size=2
        )
        torch.testing.assert_close(out.returns, torch.tensor([[-1.0, -1, -1, 0], [1, 1, 0, 0]]))
        lo, hi = (-1 + 0.2) / 0.96**0.5, (1 + 0.2) / 0.96**0.5
        torch.testing.assert_close(out.advantages, torch.tensor([[lo, lo, lo, 0], [hi, hi, 0, 0]]))

    def test_unknown_algo(self):
        with pytest.raises(ValueError, match="algo.name=.a2c. is not a known algorithm"):
            compute_advantages("a2c", scores=torch.zeros(2), token_rewards=torch.zeros(2, 4), response_mask=self.mask)
