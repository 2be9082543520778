"""Masks of a two-turn sample, derived by hand: the update trains on, and takes KL over, the policy's tokens only.

The batch (B = 2, one group of 2 for GRPO), response window R = 6:

    row 0, two turns:  a  b | e  f | c  d      token_owner [1, 1, 0, 0, 1, 1]   (e f: the environment's)
    row 1, one turn:   g  h  i                 token_owner [1, 1, 1]            (padded with 3 zeros)

so trained_mask = [[1,1,0,0,1,1], [1,1,1,0,0,0]] and response_mask (attention) = [[1]*6, [1,1,1,0,0,0]].
"""

import math

import pytest
import torch

from engines.ppo.advantages import compute_advantages, discounted_returns, gae
from engines.ppo.losses import kl_loss, policy_loss, step_norm
from engines.ppo.rewards import token_level_rewards
from engines.trainer.experience import ExperienceBatch

OWNERS = [[1, 1, 0, 0, 1, 1], [1, 1, 1]]
TRAINED = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)


def _batch(scores=(1.0, 0.0)) -> ExperienceBatch:
    return ExperienceBatch.from_lists(
        prompt_ids=[[1, 20, 7], [1, 21]],
        response_ids=[[11, 12, 24, 25, 13, 2], [14, 15, 2]],
        scores=list(scores),
        ref_logprobs=[[-1.0] * 6, [-1.0] * 3],
        rollout_logprobs=[[-0.5, -0.5, 0.0, 0.0, -0.5, -0.5], [-0.5] * 3],
        group_ids=[0, 0],
        finish_reasons=["stop", "stop"],
        token_owner=OWNERS,
    )


def test_masks_from_token_owner():
    batch = _batch()
    torch.testing.assert_close(batch.policy_mask, TRAINED)
    torch.testing.assert_close(batch.trained_mask, TRAINED)
    torch.testing.assert_close(batch.loss_mask(mask_truncated=False), TRAINED)
    # the environment's tokens stay in the attention mask: the policy's second turn is conditioned on them
    torch.testing.assert_close(batch.response_mask, torch.tensor([[1.0] * 6, [1, 1, 1, 0, 0, 0]]))
    # select / pad keep the mask row for row
    torch.testing.assert_close(batch.select(torch.tensor([1])).trained_mask, TRAINED[1:])


def test_single_turn_batch_has_no_policy_mask():
    batch = ExperienceBatch.from_lists([[1, 2]], [[3, 4]], [1.0], [[0.0, 0.0]])
    assert batch.policy_mask is None
    torch.testing.assert_close(batch.trained_mask, batch.response_mask)


def test_bad_owners_are_named():
    with pytest.raises(ValueError, match="row 1: token_owner has 2 values for 3 response tokens"):
        ExperienceBatch.from_lists(
            [[1], [1]], [[3], [3, 4, 5]], [0.0, 0.0], [[0.0], [0.0] * 3], token_owner=[[1], [1, 0]]
        )
    with pytest.raises(ValueError, match=r"row 0: token_owner holds \[2\]"):
        ExperienceBatch.from_lists([[1]], [[3, 4]], [0.0], [[0.0, 0.0]], token_owner=[[1, 2]])


def test_grpo_loss_and_kl_by_hand():
    """GRPO, KL in the loss (k1), token_mean over the step.

    Group advantage: scores (1, 0), mean 0.5, std (N - 1) = sqrt(0.5) -> a = 0.5 / (sqrt(0.5) + 1e-6) = 0.70711
    for row 0 and -a for row 1, broadcast over each row's POLICY tokens only (environment tokens: 0).
    log_ratio = logprobs - old: row 0 [0.1, 0, 5, -5, 0, 0.3] (the 5s on the environment's tokens must not count),
    row 1 [0, 0, 0] (+ padding junk 9).
    Per-token loss max(-A r, -A clip(r, 0.8, 1.2)):
        row 0 (A = a > 0): -a e^0.1, -a, -a, -a * 1.2 (e^0.3 = 1.35 clipped to 1.2)
        row 1 (A = -a):    +a, +a, +a
    token_mean over the 7 policy tokens: (-a (e^0.1 + 3.2) + 3a) / 7 = -a (0.2 + e^0.1) / 7 = -0.131842.
    k1 KL to the reference (ref = old here) = mean log_ratio over the same 7 tokens = 0.4 / 7.
    """
    batch = _batch()
    mask = batch.trained_mask
    rewards = token_level_rewards(batch.scores, torch.zeros(2, 6), mask, kl_coef=0.0)
    adv = compute_advantages("grpo", scores=batch.scores, token_rewards=rewards, response_mask=mask, group_size=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv.advantages, torch.tensor([[a, a, 0, 0, a, a], [-a, -a, -a, 0, 0, 0]]))
    old = torch.full((2, 6), -1.0)
    logprobs = old + torch.tensor([[0.1, 0.0, 5.0, -5.0, 0.0, 0.3], [0.0, 0.0, 0.0, 9.0, 9.0, 9.0]])
    loss_mask = batch.loss_mask(mask_truncated=False)
    norm = step_norm(loss_mask, max_len=6.0)
    assert norm.num_tokens == 7.0
    agg = dict(agg_mode="token_mean", num_tokens=norm.num_tokens, num_seqs=norm.num_seqs, max_len=norm.max_len)
    loss = policy_loss(logprobs, old, adv.advantages, loss_mask, 0.2, 0.2, **agg).loss
    expected = -a * (0.2 + math.exp(0.1)) / 7
    assert abs(float(loss) - expected) < 1e-6 and abs(expected - -0.131842) < 1e-6
    kl = kl_loss(logprobs, old, loss_mask, "k1", 10.0, **agg)
    assert abs(float(kl) - 0.4 / 7) < 1e-6
    # Property: whatever the log-probs of the environment's tokens, the loss and the KL are the same.
    moved = logprobs.clone()
    moved[0, 2:4] = torch.tensor([-30.0, 40.0])
    assert float(policy_loss(moved, old, adv.advantages, loss_mask, 0.2, 0.2, **agg).loss) == float(loss)
    assert float(kl_loss(moved, old, loss_mask, "k1", 10.0, **agg)) == float(kl)


def test_gae_skips_environment_tokens_by_hand():
    """Row 0 alone, gamma 0.9, lambda 0.8 (gamma * lambda = 0.72); the score 1 lands on the last policy token and
    KL-in-reward (coef 0.1, kl 0.5 per policy token) on every policy token: r = [-.05, -.05, 0, 0, -.05, .95].
    Values V = [0.1, 0.2, 9, 9, 0.3, 0.4] (the 9s, the critic's values at environment tokens, must not be read).
    Backwards over the policy tokens only (the environment's are no time step: no discount, no value):
        t=5: delta = 0.95 - 0.4 = 0.55                          A5 = 0.55
        t=4: delta = -0.05 + 0.9 * 0.4 - 0.3 = 0.01            A4 = 0.01 + 0.72 * 0.55 = 0.406
        t=1: delta = -0.05 + 0.9 * 0.3 - 0.2 = 0.02            A1 = 0.02 + 0.72 * 0.406 = 0.31232
        t=0: delta = -0.05 + 0.9 * 0.2 - 0.1 = 0.03            A0 = 0.03 + 0.72 * 0.31232 = 0.2548704
    returns = A + V on policy tokens, 0 on the environment's.
    """
    mask = TRAINED[:1]
    kl = torch.tensor([[0.5, 0.5, 7.0, 7.0, 0.5, 0.5]])
    rewards = token_level_rewards(torch.tensor([1.0]), kl, mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.05, 0, 0, -0.05, 0.95]]))
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = torch.tensor([[0.2548704, 0.31232, 0, 0, 0.406, 0.55]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values * mask)
    # REINFORCE++'s reward-to-go skips them too: G4 = -0.05 + 0.9 * 0.95, G1 = -0.05 + 0.9 * G4, ...
    g5, g4 = 0.95, -0.05 + 0.9 * 0.95
    g1 = -0.05 + 0.9 * g4
    g0 = -0.05 + 0.9 * g1
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.9), torch.tensor([[g0, g1, 0, 0, g4, g5]]))


def test_contiguous_masks_give_the_plain_recurrence():
    # Single-turn rows (one run of 1s, then padding) are unchanged by the skipping: against a loop written here.
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv, _ = gae(rewards, values, mask, gamma=0.95, lam=0.9)
    for b in range(3):
        n, running, expected = int(mask[b].sum()), 0.0, torch.zeros(5)
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            running = float(rewards[b, t]) + 0.95 * next_value - float(values[b, t]) + 0.95 * 0.9 * running
            expected[t] = running
        torch.testing.assert_close(adv[b], expected)
