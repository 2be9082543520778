"""Every algorithm through the real DeepSpeed trainer, and the training recipes: loss aggregation through
micro-batch accumulation, the pre-clip grad norm at ZeRO stage 0, truncated importance sampling, the
overlong penalty, masking truncated samples, and the running reward normaliser across a resume.

Expected values are derived by hand from the batch (scores, response lengths) in the comments, with
algo.kl_coef = 0 so that token rewards are the bare score at the last token (gamma = 1).
"""

import dataclasses
import math

import pytest
import torch

from engines.trainer.ppo_trainer import PPOTrainer
from tests.integration.test_trainer import _batch, _cfg, _params

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def batches(tiny_model_dir):
    return _batch(tiny_model_dir, 1), _batch(tiny_model_dir, 2)


def _rows(result_lists):
    return [torch.tensor(row) for row in result_lists]


def _group_partner(b: int) -> int:
    return b + 1 if b % 2 == 0 else b - 1  # groups of 2: rows (0, 1), (2, 3), ...


def _assert_rows_constant(rows, expected, atol=1e-5):
    for b, row in enumerate(rows):
        torch.testing.assert_close(row, torch.full_like(row, float(expected[b])), atol=atol, rtol=0)


def _check_property(algo, trainer, result, scores):
    adv, ret = _rows(result.advantages), _rows(result.returns)
    mean_g = [(scores[b] + scores[_group_partner(b)]) / 2 for b in range(8)]
    if algo == "ppo":
        # GAE with gamma = lam = 1 and the score at the last token: A_t = s - V_t, so R_t = A_t + V_t = s
        _assert_rows_constant(ret, scores, atol=1e-4)
        assert result.metrics["loss/value"] > 0 and "optim/critic_grad_norm" in result.metrics
    elif algo == "grpo":
        # G = 2: std (N - 1) = |s1 - s2| / sqrt(2), so (s - mean) / std = +-1/sqrt(2) (eps 1e-6 aside)
        expected = [
            (scores[b] - mean_g[b]) / (abs(scores[b] - scores[_group_partner(b)]) / math.sqrt(2) + 1e-6)
            for b in range(8)
        ]
        assert all(abs(abs(e) - 1 / math.sqrt(2)) < 1e-4 for e in expected)
        _assert_rows_constant(adv, expected)
    elif algo == "dr_grpo":
        _assert_rows_constant(adv, [scores[b] - mean_g[b] for b in range(8)])  # no std
        assert trainer.loss_agg == "seq_mean_token_sum_norm"  # Dr. GRPO's aggregation by default
    elif algo == "rloo":
        _assert_rows_constant(adv, [scores[b] - scores[_group_partner(b)] for b in range(8)])  # leave-one-out
    elif algo in ("reinforce_pp", "reinforce_pp_baseline"):
        baseline = [0.0] * 8 if algo == "reinforce_pp" else mean_g
        _assert_rows_constant(ret, [scores[b] - baseline[b] for b in range(8)])  # reward-to-go, gamma 1
        flat = torch.cat(adv)  # whitened over all response tokens of the batch
        assert float(flat.mean()) == pytest.approx(0.0, abs=1e-5)
        assert float(flat.var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("algo", ["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_every_algorithm_trains_through_the_trainer(tiny_model_dir, batches, algo):
    cfg = _cfg(tiny_model_dir, **{"algo.name": algo, "algo.kl_coef": 0.0, "train.ppo_epochs": 1})
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    assert (trainer.critic is not None) == (algo == "ppo")
    before = _params(trainer.actor)
    first = trainer.update(batches[0])
    moved = _params(trainer.actor)
    second = trainer.update(batches[1])
    for result in (first, second):
        assert all(math.isfinite(v) for v in result.metrics.values()), result.metrics
    assert any(not torch.equal(before[k], moved[k]) for k in before)
    assert any(not torch.equal(moved[k], v) for k, v in _params(trainer.actor).items())
    _check_property(algo, trainer, first, batches[0].scores.tolist())


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_loss_aggregation_through_micro_batch_accumulation(tiny_model_dir, batches, mode):
    """One optimizer step over 8 rows, as 1 micro-batch of 8 or 4 shuffled micro-batches of 2 (unequal
    lengths, each padded to its own width). reinforce_pp without whitening and kl_coef 0: A = s_b on every
    token of row b, and the step's ratio is 1, so the loss is -aggregate(A) over the whole step:
        token_mean: -sum_b s_b L_b / sum_b L_b;   seq_mean_token_mean: -sum_b s_b / 8;
        seq_mean_token_sum_norm (constant 10): -sum_b s_b L_b / (8 * 10)."""
    scores = batches[0].scores.tolist()
    lengths = batches[0].response_mask.sum(dim=1).tolist()
    weighted = sum(s * n for s, n in zip(scores, lengths))
    expected = {
        "token_mean": -weighted / sum(lengths),
        "seq_mean_token_mean": -sum(scores) / 8,
        "seq_mean_token_sum_norm": -weighted / 80,
    }[mode]
    norms = []
    for micro in (8, 2):
        extra = {"algo.loss_agg_norm": 10} if mode == "seq_mean_token_sum_norm" else {}
        cfg = _cfg(
            tiny_model_dir,
            **{
                "algo.name": "reinforce_pp",
                "algo.whiten_advantages": False,
                "algo.kl_coef": 0.0,
                "algo.loss_agg": mode,
                "train.ppo_epochs": 1,
                "train.micro_batch_size": micro,
                **extra,
            },
        )
        trainer = PPOTrainer(cfg, str(tiny_model_dir))
        metrics = trainer.update(batches[0]).metrics
        assert metrics["loss/policy"] == pytest.approx(expected, abs=1e-5), micro
        norms.append(metrics["optim/actor_grad_norm"])
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-4)  # same gradient however split


def test_zero_stage_0_reports_the_pre_clip_grad_norm(tiny_model_dir, batches):
    """DeepSpeed keeps no norm at stage 0; the trainer's own equals the one stage 2's optimizer computes for
    the same first step (same seed, batch and weights). max_grad_norm 1e-3 clips hard: the norm reported is
    the one before clipping, far above it."""
    norms = []
    for stage in (0, 2):
        cfg = _cfg(tiny_model_dir, **{"train.zero_stage": stage, "train.ppo_epochs": 1, "train.max_grad_norm": 1e-3})
        metrics = PPOTrainer(cfg, str(tiny_model_dir)).update(batches[0]).metrics
        norms.append((metrics["optim/actor_grad_norm"], metrics["optim/critic_grad_norm"]))
    (actor0, critic0), (actor2, critic2) = norms
    assert actor0 > 1e-2 and critic0 > 1e-2
    assert actor0 == pytest.approx(actor2, rel=1e-4) and critic0 == pytest.approx(critic2, rel=1e-4)


def _recipe_batch(batch, finish_reasons):
    # sampler log-probs = reference's (= the initial trainer's) -0.5 on even and +0.5 on odd positions:
    # raw weights exp(old - rollout) = e^0.5 = 1.649 (over the cap 1.5) and e^-0.5 = 0.607
    shift = torch.where(torch.arange(batch.ref_logprobs.shape[1]) % 2 == 0, -0.5, 0.5)
    rollout = (batch.ref_logprobs + shift) * batch.response_mask
    truncated = torch.tensor([reason == "length" for reason in finish_reasons])
    return dataclasses.replace(batch, rollout_logprobs=rollout, truncated=truncated)


def test_recipes_by_hand_and_the_normaliser_across_a_resume(tiny_model_dir, batches, tmp_path):
    settings = {
        "algo.name": "grpo",
        "algo.kl_coef": 0.0,
        "train.ppo_epochs": 1,
        "train.micro_batch_size": 8,
        "rollout.max_new_tokens": 5,
        "reward.overlong": "{buffer: 3, penalty: 1.0}",
        "reward.normalize": "running",
        "algo.tis_cap": 1.5,
        "train.mask_truncated": True,
    }
    cfg = _cfg(tiny_model_dir, **settings)
    lengths = [batches[i].response_mask.sum(dim=1).long().tolist() for i in range(2)]
    # response lengths are 4 1 4 5 1 5 4 4 and 2 4 3 5 3 4 2 2: the 5-token ones ran into the cap
    recipe = [_recipe_batch(batches[i], ["length" if n == 5 else "stop" for n in lengths[i]]) for i in range(2)]
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    metrics = trainer.update(recipe[0]).metrics
    scores = batches[0].scores.double()
    kept = [b for b in range(8) if lengths[0][b] < 5]
    assert 0 < len(kept) < 8  # the batch has both kinds (seeded)
    tokens = [(b, t) for b in kept for t in range(lengths[0][b])]
    # TIS over the tokens left in the loss: 1.5 at even positions, e^-0.5 at odd ones
    weights = [1.5 if t % 2 == 0 else math.exp(-0.5) for _, t in tokens]
    assert metrics["tis/weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-4)
    assert metrics["tis/clipfrac"] == pytest.approx(sum(t % 2 == 0 for _, t in tokens) / len(tokens))
    # overlong (L_max 5, buffer 3): -(L - 2) / 3 for L in (2, 5]: lengths 4 1 4 5 1 5 4 4 ->
    # (-2/3 * 4 - 1 * 2) / 8 = -7/12; running moments = this batch's (population std)
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-7 / 12, rel=1e-6)
    assert metrics["response/truncated_fraction"] == pytest.approx(1 - len(kept) / 8)
    assert metrics["reward/running_mean"] == pytest.approx(float(scores.mean()), rel=1e-9)
    assert metrics["reward/running_std"] == pytest.approx(float(scores.std(unbiased=False)), rel=1e-9)
    trainer.save(str(tmp_path))
    resumed = PPOTrainer(cfg, str(tmp_path / "policy"), trainer_state_dir=str(tmp_path / "trainer"))
    assert resumed.reward_normalizer.state_dict() == trainer.reward_normalizer.state_dict()
    assert resumed.reward_normalizer.count == 8.0
    live, again = trainer.update(recipe[1]).metrics, resumed.update(recipe[1]).metrics
    both = torch.cat([scores, batches[1].scores.double()])  # merged: the moments of all 16 rewards
    for m in (live, again):
        assert m["reward/running_mean"] == pytest.approx(float(both.mean()), rel=1e-9)
        assert m["reward/running_std"] == pytest.approx(float(both.std(unbiased=False)), rel=1e-9)
    assert again["loss/policy"] == live["loss/policy"]
    for k, v in _params(resumed.actor).items():
        assert torch.equal(v, _params(trainer.actor)[k]), k


def test_masking_every_sample_leaves_the_weights_alone(tiny_model_dir, batches):
    """All samples truncated and masked: no token is in the loss, the gradient is 0, Adam moves nothing."""
    cfg = _cfg(
        tiny_model_dir,
        **{"algo.name": "grpo", "algo.kl_coef": 0.0, "train.ppo_epochs": 1, "train.mask_truncated": True},
    )
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    before = _params(trainer.actor)
    metrics = trainer.update(dataclasses.replace(batches[0], truncated=torch.ones(8, dtype=torch.bool))).metrics
    assert metrics["loss/policy"] == 0.0 and metrics["response/truncated_fraction"] == 1.0
    assert "policy/clipfrac" not in metrics  # no token to measure it on
    for k, v in _params(trainer.actor).items():
        assert torch.equal(v, before[k]), k
