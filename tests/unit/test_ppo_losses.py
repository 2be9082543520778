"""aggregate, policy_loss, value_loss, entropy_loss and kl_loss: hand values and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.ppo.losses import (
    aggregate,
    entropy_loss,
    kl_loss,
    policy_loss,
    step_norm,
    truncated_is_weights,
    value_loss,
)

seeds = st.integers(0, 2**31 - 1)


class TestAggregate:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])

    @pytest.mark.parametrize(
        "mode, expected",
        [
            ("token_mean", 10 / 4),  # (1 + 2 + 3 + 4) / 4 tokens
            ("seq_mean_token_mean", (2 + 4) / 2),  # row means 2 and 4
            ("seq_mean_token_sum_norm", 10 / (2 * 3)),  # sum / (2 seqs * max_len 3)
        ],
    )
    def test_by_hand(self, mode, expected):
        assert aggregate(self.loss, self.mask, mode).item() == pytest.approx(expected)

    def test_step_denominators(self):
        assert aggregate(self.loss, self.mask, "token_mean", num_tokens=8).item() == pytest.approx(10 / 8)
        got = aggregate(self.loss, self.mask, "seq_mean_token_sum_norm", num_seqs=4, max_len=5)
        assert got.item() == pytest.approx(10 / 20)

    @settings(max_examples=25, deadline=None)
    @given(seeds, st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]))
    def test_micro_batch_split_does_not_change_loss_or_gradient(self, seed, mode):
        generator = torch.Generator().manual_seed(seed)
        batch, width = 7, 5
        lengths = torch.randint(0, width + 1, (batch,), generator=generator)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        weights = torch.randn(batch, width, generator=generator, dtype=torch.float64)
        step = dict(num_tokens=max(int(mask.sum()), 1), num_seqs=batch, max_len=width)

        full_param = torch.ones(batch, width, dtype=torch.float64, requires_grad=True)
        full = aggregate(full_param * weights, mask, mode, **step)
        full.backward()

        split_param = torch.ones(batch, width, dtype=torch.float64, requires_grad=True)
        bounds = [0, 2, 3, 7]  # micro-batches of 2, 1 and 4 rows
        total = sum(
            aggregate(split_param[a:b] * weights[a:b], mask[a:b], mode, **step) for a, b in zip(bounds, bounds[1:])
        )
        total.backward()
        assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
        torch.testing.assert_close(split_param.grad, full_param.grad, rtol=1e-12, atol=1e-12)

    def test_own_token_count_is_not_split_invariant(self):
        # why num_tokens exists: per-micro-batch means of [1, 2, 3] and [4] sum to 2 + 4 = 6, not 2.5
        parts = aggregate(self.loss[:1], self.mask[:1]) + aggregate(self.loss[1:], self.mask[1:])
        assert parts.item() == pytest.approx(6.0)

    def test_nothing_counted_is_zero(self):
        assert aggregate(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0

    def test_errors(self):
        with pytest.raises(ValueError, match="agg_mode must be one of"):
            aggregate(self.loss, self.mask, "sum")
        with pytest.raises(ValueError, match="num_tokens must be > 0"):
            aggregate(self.loss, self.mask, num_tokens=0)
        with pytest.raises(ValueError, match="mask has shape"):
            aggregate(self.loss, self.mask[:, :2])


class TestStepNorm:
    """The trainer's accumulation: micro-batches of one optimizer step, each padded to its own width and
    aggregated with step_norm of the whole step, add up to the aggregate of the whole step at once."""

    # step of 4 rows: lengths 1, 3 | 2, 4 (two micro-batches of unequal padded widths 3 and 4)
    mb1 = torch.tensor([[2.0, 0.0, 0.0], [1.0, 2.0, 3.0]]), torch.tensor([[1, 0, 0], [1, 1, 1]])
    mb2 = (torch.tensor([[4.0, 6.0, 0.0, 0.0], [1.0, 1.0, 1.0, 5.0]]), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))

    def _full(self):
        pad = torch.zeros(2, 1)
        return (
            torch.cat([torch.cat([self.mb1[0], pad], 1), self.mb2[0]]),
            torch.cat([torch.cat([self.mb1[1], pad.long()], 1), self.mb2[1]]),
        )

    @pytest.mark.parametrize(
        "mode, expected",
        [
            # token sums 2, 6, 10, 8 = 26 over 10 tokens
            ("token_mean", 26 / 10),
            # row means 2, 2, 5, 2 -> 11 / 4 rows
            ("seq_mean_token_mean", 11 / 4),
            # 26 / (4 rows * constant 8)
            ("seq_mean_token_sum_norm", 26 / 32),
        ],
    )
    def test_two_unequal_micro_batches_add_up_to_the_step(self, mode, expected):
        full_loss, full_mask = self._full()
        norm = step_norm(full_mask, max_len=8)
        assert (norm.num_tokens, norm.num_seqs, norm.max_len) == (10.0, 4.0, 8.0)
        parts = [torch.tensor(v, requires_grad=True) for v in (self.mb1[0].tolist(), self.mb2[0].tolist())]
        summed = sum(aggregate(x, m, mode, *norm) for x, m in zip(parts, (self.mb1[1], self.mb2[1])))
        full = full_loss.clone().requires_grad_(True)
        at_once = aggregate(full, full_mask, mode, *norm)
        assert summed.item() == pytest.approx(expected) and at_once.item() == pytest.approx(expected)
        summed.backward()
        at_once.backward()
        torch.testing.assert_close(torch.cat([parts[0].grad, torch.zeros(2, 1)], 1), full.grad[:2])
        torch.testing.assert_close(parts[1].grad, full.grad[2:])

    def test_own_denominators_would_differ(self):
        # each micro-batch's own token mean, averaged (DeepSpeed's 1/accumulation): (8/4 + 18/6) / 2 = 2.5,
        # not the step's 26/10: a token of the short micro-batch would weigh more
        own = (aggregate(*self.mb1, "token_mean") + aggregate(*self.mb2, "token_mean")) / 2
        assert own.item() == pytest.approx(2.5) != pytest.approx(26 / 10)

    def test_masked_rows_are_not_responses_of_the_step(self):
        # train.mask_truncated zeroes a row's loss mask: it counts neither as tokens nor as a response
        mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
        assert tuple(step_norm(mask, 4.0)) == (3.0, 2.0, 4.0)
        assert tuple(step_norm(torch.zeros(2, 3), 4.0)) == (1.0, 1.0, 4.0)  # nothing counted: loss 0, no 0/0
        with pytest.raises(ValueError, match="max_len must be > 0"):
            step_norm(mask, 0.0)


class TestTruncatedImportanceSampling:
    def test_by_hand(self):
        # log w = old - rollout = [0.5, -1.0 | 2.0, (pad)]; w = [1.6487, 0.3679 | 7.389]; cap 1.5:
        # truncated = [1.5, 0.3679 | 1.5]; mean over 3 tokens = 1.1226; 2 of 3 tokens above the cap
        old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
        rollout = torch.tensor([[-1.5, -1.0], [-2.5, 0.0]])
        mask = torch.tensor([[1, 1], [1, 0]])
        weights, mean, clipfrac = truncated_is_weights(old, rollout, mask, cap=1.5)
        torch.testing.assert_close(weights, torch.tensor([[1.5, math.exp(-1.0)], [1.5, 0.0]]))
        assert mean.item() == pytest.approx((3.0 + math.exp(-1.0)) / 3)
        assert clipfrac.item() == pytest.approx(2 / 3)

    def test_weights_multiply_the_clipped_token_loss(self):
        # ratio 1 (logprobs = old): per token -A * w; A = [2, -1], w = [1.5, e^-1] -> mean(-3, e^-1)
        logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        weights, _, _ = truncated_is_weights(logprobs.detach(), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2), cap=1.5)
        out = policy_loss(
            logprobs, logprobs.detach(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), token_weights=weights
        )
        assert out.loss.item() == pytest.approx((-3.0 + math.exp(-1.0)) / 2)
        out.loss.backward()  # d/dlogp of -A * w * exp(logp - old) at ratio 1 = -A * w / 2 tokens
        torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.5, math.exp(-1.0) / 2]]))

    def test_on_policy_weights_are_one_and_bad_cap(self):
        lp = torch.tensor([[-0.3, -1.2, 0.0]])
        weights, mean, clipfrac = truncated_is_weights(lp, lp, torch.tensor([[1, 1, 0]]), cap=2.0)
        assert weights.tolist() == [[1.0, 1.0, 0.0]] and mean.item() == 1.0 and clipfrac.item() == 0.0
        with pytest.raises(ValueError, match="algo.tis_cap must be >= 1"):
            truncated_is_weights(lp, lp, torch.ones(1, 3), cap=0.9)


class TestPolicyLoss:
    # four tokens, clip 0.2: (ratio, A) -> per-token loss = max(-A r, -A clip(r)), clipped?
    # (1.5, +1): max(-1.5, -1.2) = -1.2  clipped     (0.5, +1): max(-0.5, -0.8) = -0.5  not clipped
    # (1.5, -1): max( 1.5,  1.2) =  1.5  not clipped (0.5, -1): max( 0.5,  0.8) =  0.8  clipped
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])

    def test_by_hand(self):
        old = torch.full((1, 4), -2.0)
        out = policy_loss(old + self.ratios.log(), old, self.advantages, torch.ones(1, 4), 0.2, 0.2)
        assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)  # 0.15
        assert out.clipfrac.item() == pytest.approx(0.5)
        # k3 = (r - 1) - ln r: r = 1.5 -> 0.0945349; r = 0.5 -> 0.1931472
        assert out.approx_kl.item() == pytest.approx((0.5 - math.log(1.5) - 0.5 + math.log(2)) / 2, rel=1e-5)
        assert out.ratio_mean.item() == pytest.approx(1.0)

    def test_gradient_inside_the_clip_range(self):
        # r = 1.1 inside [0.8, 1.2]: d(-A r)/d logp = -A r; token mean over 2 tokens halves it
        logp = torch.tensor([[math.log(1.1), 0.0]], requires_grad=True)
        out = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2))
        out.loss.backward()
        torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 * 1.1 / 2, 0.0]]))

    def test_clip_higher(self):
        # r = 1.25, A = 1: clip_high 0.2 caps at 1.2; DAPO's clip_high 0.28 leaves 1.25
        logp = torch.tensor([[math.log(1.25)]])
        symmetric = policy_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2)
        higher = policy_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
        assert symmetric.loss.item() == pytest.approx(-1.2) and higher.loss.item() == pytest.approx(-1.25)

    @settings(max_examples=50, deadline=None)
    @given(st.lists(st.floats(-1, 1), min_size=1, max_size=6), seeds)
    def test_ratio_one_means_no_clipping(self, advantages, seed):
        logp = torch.randn(1, len(advantages), generator=torch.Generator().manual_seed(seed))
        adv = torch.tensor([advantages])
        out = policy_loss(logp, logp.clone(), adv, torch.ones_like(adv))
        assert out.clipfrac.item() == 0.0 and out.approx_kl.item() == 0.0
        assert out.loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)

    @settings(max_examples=50, deadline=None)
    @given(st.floats(-3, 3), st.floats(-3, 3), st.floats(0.01, 2), st.sampled_from([None, 2.0]))
    def test_higher_advantage_lower_loss(self, log_ratio, advantage, increase, dual_clip):
        logp = torch.tensor([[log_ratio]])

        def loss_at(a):
            return policy_loss(
                logp, torch.zeros(1, 1), torch.tensor([[a]]), torch.ones(1, 1), dual_clip=dual_clip
            ).loss.item()

        assert loss_at(advantage + increase) < loss_at(advantage)

    def test_dual_clip_caps_negative_advantage_loss(self):
        # r = e^2 = 7.39, A = -1: standard loss max(7.39, 1.2) = 7.39; dual clip c = 3 caps it at 3
        logp = torch.tensor([[2.0, 2.0]], requires_grad=True)
        adv = torch.tensor([[-1.0, 1.0]])
        plain = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2))
        capped = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), dual_clip=3.0)
        # token 2 (A = +1, r clipped to 1.2) is the same in both: -1.2
        assert plain.loss.item() == pytest.approx((math.exp(2) - 1.2) / 2)
        assert capped.loss.item() == pytest.approx((3.0 - 1.2) / 2)
        capped.loss.backward()
        assert logp.grad.abs().sum().item() == 0.0  # both tokens are on a flat (clipped/capped) branch

    def test_errors(self):
        x = torch.zeros(1, 2)
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            policy_loss(x, x, x, x, dual_clip=1.0)
        with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\)"):
            policy_loss(x, x, x, x, clip_low=1.0)
        with pytest.raises(ValueError, match="advantages has shape"):
            policy_loss(x, x, torch.zeros(2, 2), x)


class TestValueLoss:
    def test_by_hand(self):
        # old 0, new 1, clip 0.5 -> clipped value 0.5.
        # target 0: errors 1 vs 0.25 -> max 1 (unclipped)   target 2: errors 1 vs 2.25 -> 2.25 (clipped)
        out = value_loss(torch.ones(1, 2), torch.zeros(1, 2), torch.tensor([[0.0, 2.0]]), torch.ones(1, 2), 0.5)
        assert out.loss.item() == pytest.approx(0.5 * (1.0 + 2.25) / 2)
        assert out.clipfrac.item() == pytest.approx(0.5)

    def test_no_clip_is_half_mse(self):
        values = torch.tensor([[1.0, 3.0, 100.0]])
        mask = torch.tensor([[1, 1, 0]])
        out = value_loss(values, torch.zeros(1, 3), torch.zeros(1, 3), mask, None)
        assert out.loss.item() == pytest.approx(0.5 * (1 + 9) / 2) and out.clipfrac.item() == 0.0

    def test_bad_clip(self):
        x = torch.zeros(1, 2)
        with pytest.raises(ValueError, match="value_clip must be > 0"):
            value_loss(x, x, x, x, value_clip=0.0)


class TestEntropyAndKLLoss:
    def test_entropy_loss_is_negative_mean_entropy(self):
        entropy = torch.tensor([[math.log(4.0), 1.0, 7.0]])
        got = entropy_loss(entropy, torch.tensor([[1, 1, 0]]))
        assert got.item() == pytest.approx(-(math.log(4.0) + 1.0) / 2)

    def test_kl_loss_k3_by_hand(self):
        # log ratio ln 2 -> k3 = 1/2 - 1 + ln 2 = 0.1931472; second token equal -> 0; token mean of 2
        logp = torch.tensor([[math.log(2.0), -1.0]])
        ref = torch.tensor([[0.0, -1.0]])
        got = kl_loss(logp, ref, torch.ones(1, 2), "k3")
        assert got.item() == pytest.approx((0.5 - 1 + math.log(2.0)) / 2, rel=1e-6)
