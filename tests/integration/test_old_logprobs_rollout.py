"""algo.old_logprobs = rollout on the real DeepSpeed trainer: the sampler's log-probs become the PPO ratio's
denominator and the actor's no-grad forward before the first step is gone.

Expected values by hand: the tiny model's reference log-probs (a separate ReferenceModel forward of the same
weights) are the trainer's own log-probs before any step, so
- rows whose rollout_logprobs ARE those log-probs train like the default `recompute` (same weights after);
- rows whose rollout_logprobs are those minus log 2 (the sampler "thought" each token half as likely) start
  the step at ratio exp(new - old) = 2 on every token; with clip_high 0.2 the clipped branch is the larger loss
  exactly where the advantage is positive, so policy/clipfrac is the share of tokens in rows with A > 0.
"""

import dataclasses
import math

import pytest
import torch

from engines.trainer.ppo_trainer import PPOTrainer
from tests.integration.test_trainer import _batch, _cfg, _params

pytestmark = pytest.mark.slow

# one optimizer step over the 8 rows, two micro-batches (so the default recomputes the old log-probs in a
# no-grad pass of its own: the first-forward shortcut needs a single micro-batch); GRPO: no critic, and with
# groups of two distinct scores every advantage is +-1/sqrt(2)
_SETTINGS = {
    "algo.name": "grpo",
    "algo.kl_coef": 0.0,
    "algo.kl_in_reward": "false",
    "train.ppo_epochs": 1,
    "train.train_batch_size": 8,
    "train.micro_batch_size": 4,
}


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    b = _batch(tiny_model_dir, 3)
    return dataclasses.replace(b, rollout_logprobs=b.ref_logprobs.clone())


def _trainer(model_dir, mode: str, **settings) -> PPOTrainer:
    return PPOTrainer(_cfg(model_dir, **{**_SETTINGS, **settings, "algo.old_logprobs": mode}), str(model_dir))


def _count_no_grad_forwards(trainer: PPOTrainer) -> list[int]:
    """A forward pre-hook on the actor's module (from outside): how many of its forwards ran without grad."""
    calls = [0]

    def hook(_module, _args, _kwargs):
        if not torch.is_grad_enabled():
            calls[0] += 1

    trainer.actor.module.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def test_the_sampler_logprobs_of_the_same_weights_train_like_recompute(tiny_model_dir, batch):
    """Two optimizer steps of 4 rows (one micro-batch each): `recompute` runs the no-grad pass over the second
    step's 4 rows only (the first step's old log-probs come from its own forward: first_step_old.py), `rollout`
    runs none; both train alike, and every row's old log-probs handed back are the starting weights' own."""
    two_steps = {"train.train_batch_size": 4}
    recompute, rollout = (
        _trainer(tiny_model_dir, "recompute", **two_steps),
        _trainer(tiny_model_dir, "rollout", **two_steps),
    )
    no_grad = {"recompute": _count_no_grad_forwards(recompute), "rollout": _count_no_grad_forwards(rollout)}
    before = _params(rollout.actor)
    result_recompute, result_rollout = recompute.update(batch), rollout.update(batch)
    assert no_grad == {"recompute": [1], "rollout": [0]}  # one micro-batch of old log-probs (step 2's), then none
    after_recompute, after_rollout = _params(recompute.actor), _params(rollout.actor)
    moved = max(float((after_rollout[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # the step did move the weights, so agreeing below is not agreeing on nothing
    for name in before:
        torch.testing.assert_close(after_rollout[name], after_recompute[name], atol=2e-5, rtol=0)
    for row, expected in zip(result_rollout.old_logprobs, batch.rollout_logprobs):  # the old ones handed back
        torch.testing.assert_close(torch.tensor(row), expected[: len(row)], atol=0, rtol=0)
    for row, expected in zip(result_recompute.old_logprobs, batch.ref_logprobs):  # the start weights', every row
        torch.testing.assert_close(torch.tensor(row), expected[: len(row)], atol=1e-5, rtol=0)
    assert "rollout/logprob_abs_diff" in result_recompute.metrics
    assert "rollout/logprob_abs_diff" not in result_rollout.metrics  # old IS rollout there: nothing measured


def test_the_ratio_is_taken_against_the_sampler_logprobs(tiny_model_dir, batch):
    halved = dataclasses.replace(batch, rollout_logprobs=batch.rollout_logprobs - math.log(2.0))
    mask = halved.response_mask.float()
    result = _trainer(tiny_model_dir, "rollout").update(halved)
    assert result.metrics["policy/ratio_mean"] == pytest.approx(2.0, abs=1e-3)
    positive = torch.tensor([row[0] > 0 for row in result.advantages], dtype=torch.float32)
    expected_clipfrac = float((mask.sum(dim=1) * positive).sum() / mask.sum())
    assert 0 < expected_clipfrac < 1
    assert result.metrics["policy/clipfrac"] == pytest.approx(expected_clipfrac, abs=1e-6)
    control = _trainer(tiny_model_dir, "recompute").update(halved)  # the default ignores the sampler's values
    assert control.metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-3)


def test_rows_without_sampler_logprobs_are_refused_naming_the_setting(tiny_model_dir, batch):
    bare = dataclasses.replace(batch, rollout_logprobs=None)
    with pytest.raises(ValueError, match=r"algo\.old_logprobs='rollout'.*no rollout_logprobs"):
        _trainer(tiny_model_dir, "rollout").update(bare)
