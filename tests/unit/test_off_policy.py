"""Decoupled PPO (engines/ppo/off_policy.py): the loss by hand on small tensors, the cap rules, and k = 0."""

import math

import pytest
import torch

from engines.ppo.losses import policy_loss, truncated_is_weights
from engines.ppo.off_policy import ASYNC_IS_CAP, behaviour_is_cap, is_weight_metric_names
from ppoflow.config import load_config


def test_decoupled_loss_by_hand():
    # One response, two tokens, A = [1, -1], clip 0.2, cap 2.
    # pi_theta = [0.5, 0.3], pi_prox = [0.4, 0.3], pi_behav = [0.1, 0.6]
    # r = pi_theta / pi_prox = [1.25, 1.0]; w = min(pi_prox / pi_behav, 2) = [min(4, 2), 0.5] = [2, 0.5]
    # token 1 (A = 1):  max(-1.25, -clip(1.25) = -1.2) = -1.2, times w = 2   -> -2.4
    # token 2 (A = -1): max(1.0, 1.0) = 1.0,                     times w = 0.5 ->  0.5
    # token mean: (-2.4 + 0.5) / 2 = -0.95; weight mean (2 + 0.5) / 2 = 1.25; 1 of 2 weights above the cap
    theta = torch.log(torch.tensor([[0.5, 0.3]])).requires_grad_()
    prox = torch.log(torch.tensor([[0.4, 0.3]]))
    behav = torch.log(torch.tensor([[0.1, 0.6]]))
    mask = torch.ones(1, 2)
    weights, mean, clipfrac = truncated_is_weights(prox, behav, mask, cap=2.0)
    out = policy_loss(theta, prox, torch.tensor([[1.0, -1.0]]), mask, 0.2, 0.2, token_weights=weights)
    assert out.loss.item() == pytest.approx(-0.95, abs=1e-6)
    assert mean.item() == pytest.approx(1.25) and clipfrac.item() == pytest.approx(0.5)
    # The clip is taken against the proximal policy: token 1 (r = 1.25 > 1.2) is clipped and has no gradient;
    # token 2 (r = 1) is not: d/dlogp2 of -A * w * exp(logp2 - logprox2) / 2 tokens = 1 * 0.5 * 1.0 / 2 = 0.25.
    out.loss.backward()
    torch.testing.assert_close(theta.grad, torch.tensor([[0.0, 0.25]]))


def test_on_policy_weights_leave_the_loss_exactly_as_it_was():
    # Behaviour == proximal (k = 0, same kernels): every weight is exactly 1.0, so the loss is bit for bit the
    # unweighted PPO loss (multiplying by 1.0 is exact in floating point).
    torch.manual_seed(0)
    theta, prox = torch.randn(3, 5) * 0.1 - 1.0, torch.randn(3, 5) * 0.1 - 1.0
    adv, mask = torch.randn(3, 5), (torch.rand(3, 5) > 0.3).float()
    weights, _, _ = truncated_is_weights(prox, prox, mask, cap=ASYNC_IS_CAP)
    weighted = policy_loss(theta, prox, adv, mask, token_weights=weights)
    plain = policy_loss(theta, prox, adv, mask)
    assert weighted.loss.item() == plain.loss.item()


@pytest.mark.parametrize(
    "overrides, cap, names",
    [
        ([], None, ("tis/weight_mean", "tis/clipfrac")),  # k = 0, no TIS: on-policy PPO, no weights at all
        (["algo.tis_cap=1.5"], 1.5, ("tis/weight_mean", "tis/clipfrac")),
        (["pipeline.max_staleness=1"], ASYNC_IS_CAP, ("async/is_weight_mean", "async/is_weight_clipfrac")),
        (["pipeline.max_staleness=2", "algo.tis_cap=3"], 3.0, ("async/is_weight_mean", "async/is_weight_clipfrac")),
        # the old log-probs are the sampler's: pi_prox / pi_behav would be 1 on every token, so no weights
        (
            ["pipeline.max_staleness=1", "algo.old_logprobs=rollout"],
            None,
            ("async/is_weight_mean", "async/is_weight_clipfrac"),
        ),
    ],
)
def test_the_cap_and_metric_names_follow_the_config(overrides, cap, names):
    cfg = load_config(None, overrides)
    assert behaviour_is_cap(cfg.algo.old_logprobs, cfg.algo.tis_cap, cfg.pipeline.max_staleness) == cap
    assert is_weight_metric_names(cfg.pipeline.max_staleness) == names


def test_sampler_old_logprobs_with_a_tis_cap_are_refused_naming_both():
    from ppoflow.config import ConfigError

    with pytest.raises(ConfigError, match=r"algo\.tis_cap=1\.5 with algo\.old_logprobs='rollout'"):
        load_config(None, ["algo.tis_cap=1.5", "algo.old_logprobs=rollout"])
    with pytest.raises(ConfigError, match="old_logprobs"):
        load_config(None, ["algo.old_logprobs=sampler"])


def test_staleness_outside_its_range_is_refused():
    from ppoflow.config import ConfigError

    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(None, ["pipeline.max_staleness=-1"])
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(None, ["pipeline.max_staleness=9"])


def test_decoupled_weight_is_the_probability_ratio():
    # w = exp(log pi_prox - log pi_behav): 0.3 / 0.6 = 0.5 below the cap, unchanged
    w, _, _ = truncated_is_weights(
        torch.tensor([[math.log(0.3)]]), torch.tensor([[math.log(0.6)]]), torch.ones(1, 1), 2.0
    )
    assert w.item() == pytest.approx(0.5)
