"""kl_penalty: hand values, properties, and the estimators' expectation against the exact KL."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.ppo.kl import kl_penalty

log_probs = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


def tensor_pair(values):
    return torch.tensor([values[0]], dtype=torch.float64), torch.tensor([values[1]], dtype=torch.float64)


class TestKLPenalty:
    def test_hand_values(self):
        # log_ratio = logp - ref = [+1, -1]
        logp = torch.tensor([[-1.0, -2.0]])
        ref = torch.tensor([[-2.0, -1.0]])
        torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[1.0, -1.0]]))
        torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.5, 0.5]]))
        # k3 = exp(-lr) + lr - 1: lr = 1 -> e^-1 = 0.3678794; lr = -1 -> e - 2 = 0.7182818
        torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([[math.exp(-1), math.e - 2]]))

    def test_clamp_bounds_k3(self):
        # ref -60 vs policy 0: log_ratio 60 -> clamped to 10; the reverse -60 -> -10
        logp = torch.tensor([[0.0, -60.0]])
        ref = torch.tensor([[-60.0, 0.0]])
        clamped = kl_penalty(logp, ref, "k3", clamp=10.0)
        expected = torch.tensor([[math.exp(-10) + 10 - 1, math.exp(10) - 10 - 1]])  # 9.0000454, 22015.47
        torch.testing.assert_close(clamped, expected)
        unclamped = kl_penalty(logp.double(), ref.double(), "k3", clamp=None)
        assert unclamped[0, 1].item() == pytest.approx(math.exp(60) - 61, rel=1e-12)

    @settings(max_examples=50, deadline=None)
    @given(st.lists(log_probs, min_size=1, max_size=8), st.sampled_from(["k1", "k2", "k3"]))
    def test_zero_when_policy_equals_reference(self, values, estimator):
        logp = torch.tensor([values])
        assert torch.equal(kl_penalty(logp, logp.clone(), estimator), torch.zeros_like(logp))

    @settings(max_examples=100, deadline=None)
    @given(log_probs, log_probs, st.sampled_from(["k2", "k3"]))
    def test_k2_k3_non_negative(self, a, b, estimator):
        logp, ref = tensor_pair((a, b))
        assert kl_penalty(logp[None], ref[None], estimator).item() >= 0.0

    @settings(max_examples=30, deadline=None)
    @given(st.integers(0, 2**31 - 1), st.sampled_from(["k1", "k3"]))
    def test_unbiased_estimators_expect_the_exact_kl(self, seed, estimator):
        # E_{y ~ p}[k(y)] summed exactly over the vocabulary equals KL(p || q) = sum p log(p / q)
        generator = torch.Generator().manual_seed(seed)
        logp = torch.log_softmax(torch.randn(1, 16, generator=generator, dtype=torch.float64), -1)
        logq = torch.log_softmax(torch.randn(1, 16, generator=generator, dtype=torch.float64), -1)
        exact = (logp.exp() * (logp - logq)).sum()
        expected = (logp.exp() * kl_penalty(logp, logq, estimator, clamp=None)).sum()
        assert expected.item() == pytest.approx(exact.item(), rel=1e-9, abs=1e-12)

    def test_gradient_of_k3(self):
        # d k3 / d logp = 1 - exp(ref - logp): at logp - ref = ln 2 it is 1 - 1/2 = 0.5
        logp = torch.tensor([[math.log(2.0)]], requires_grad=True)
        kl_penalty(logp, torch.zeros(1, 1), "k3").sum().backward()
        assert logp.grad.item() == pytest.approx(0.5, rel=1e-6)

    def test_errors(self):
        x = torch.zeros(2, 3)
        with pytest.raises(ValueError, match="estimator must be one of"):
            kl_penalty(x, x, "k4")
        with pytest.raises(ValueError, match="ref_logprobs has shape"):
            kl_penalty(x, torch.zeros(2, 4))
        with pytest.raises(ValueError, match="clamp must be > 0"):
            kl_penalty(x, x, clamp=0.0)
