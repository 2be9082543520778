"""The train/inference mismatch: its metrics by hand (engines/ppo/mismatch.py), the KL estimate against the exact
KL, and the gate's decisions (stages/mismatch_gate.py)."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from engines.ppo.mismatch import mismatch_metrics, mismatch_sums
from ppoflow.config import PPOFlowConfig
from stages.manifests import PolicyRef
from stages.mismatch_gate import FLOAT32_LIMIT, MismatchError, default_diff_limit, gate_mismatch


def test_metrics_by_hand():
    sampler = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -9.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # row 2's last two tokens are padding: its -9 must not count
    # d = trainer - sampler on the 4 masked tokens: -0.5, 0, +1, 0
    # mean |d| = 1.5 / 4; max |d| = 1; k3(d) = e^d - 1 - d: e^-0.5 - 0.5 = 0.1065307, 0, e - 2 = 0.7182818, 0
    metrics = mismatch_metrics(mismatch_sums(sampler, trainer, mask))
    assert metrics["mismatch/logprob_abs_diff_mean"] == pytest.approx(0.375)
    assert metrics["mismatch/logprob_abs_diff_max"] == 1.0
    assert metrics["mismatch/kl"] == pytest.approx((math.exp(-0.5) - 0.5 + math.e - 2) / 4)
    assert metrics["mismatch/tokens"] == 4


def test_the_kl_estimate_converges_to_the_exact_kl():
    # Tokens drawn from the sampler p; the trainer is q. E_p[k3] = KL(p || q) exactly (E_p[q/p] = 1).
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.4, 0.4, 0.2])
    exact = float((p * (p / q).log()).sum())
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))[None]
    sums = mismatch_sums(p.log()[tokens], q.log()[tokens], torch.ones_like(tokens))
    assert mismatch_metrics(sums)["mismatch/kl"] == pytest.approx(exact, rel=0.02)  # exact = 0.0253


def test_no_tokens_is_no_metric_and_shapes_must_agree():
    zeros = torch.zeros(1, 2)
    assert mismatch_metrics(mismatch_sums(zeros, zeros, zeros)) == {}
    with pytest.raises(ValueError, match="one \\(B, T\\) shape"):
        mismatch_sums(zeros, torch.zeros(1, 3), zeros)


def _cfg(**mismatch) -> PPOFlowConfig:
    return PPOFlowConfig.model_validate({"model": {"policy_path": "unused"}, "mismatch": mismatch})


POLICY = PolicyRef(version=2, checkpoint_iteration=2, uri="mem://ckpt-2", weights_id="ckpt-x")
ON_POLICY = pa.table({"policy_version": [2, 2]})
MEASURED = {"mismatch/logprob_abs_diff_mean": 0.02, "mismatch/kl": 1e-4, "loss/policy": 0.1}


def test_past_the_limit_the_update_fails_by_name_or_warns(caplog):
    with pytest.raises(MismatchError) as failed:
        gate_mismatch(_cfg(), 3, POLICY, ON_POLICY, MEASURED)
    assert str(failed.value).startswith(
        "update stage of iteration 3: mismatch/logprob_abs_diff_mean = 0.02 is over the limit 0.001"
    )
    assert gate_mismatch(_cfg(action="warn"), 3, POLICY, ON_POLICY, MEASURED) == MEASURED
    assert "over the limit 0.001" in caplog.text
    assert gate_mismatch(_cfg(max_logprob_diff_mean=0.05), 3, POLICY, ON_POLICY, MEASURED) == MEASURED
    with pytest.raises(MismatchError, match="mismatch/kl = 0.0001 is over the limit 5e-05"):
        gate_mismatch(_cfg(max_logprob_diff_mean=0.05, max_kl=5e-5), 3, POLICY, ON_POLICY, MEASURED)


def test_rows_of_another_behaviour_policy_are_measured_against_its_checkpoint(tmp_path):
    # sampled by version 1; the trainer starts from version 2: the trainer's own mismatch/* are of another policy,
    # so the gate measures the rows against checkpoint 1 (tests/integration/test_mismatch_gate.py), here absent
    stale = pa.table({"policy_version": [1, 1, 1]})
    cfg = PPOFlowConfig.model_validate({"model": {"policy_path": "unused"}, "run": {"root": str(tmp_path)}})
    with pytest.raises(RuntimeError, match="3 rows were sampled by policy version 1, whose checkpoint is needed"):
        gate_mismatch(cfg, 4, POLICY, stale, MEASURED)


def test_the_default_limit_holds_for_float32_only():
    assert default_diff_limit(_cfg()) == FLOAT32_LIMIT
    bf16 = PPOFlowConfig.model_validate({"model": {"policy_path": "unused", "autocast_dtype": "bfloat16"}})
    assert default_diff_limit(bf16) is None
    assert default_diff_limit(_cfg(max_logprob_diff_mean=0.2)) == 0.2
    # vLLM with top-p at T = 0.7 returns the truncated distribution's log-probs, not the trainer's: no default limit
    truncated = {"model": {"policy_path": "unused"}, "rollout": {"engine": "vllm", "temperature": 0.7, "top_p": 0.9}}
    assert default_diff_limit(PPOFlowConfig.model_validate(truncated)) is None
    truncated["rollout"]["engine"] = "hf"  # HF's sampler takes them before truncation
    assert default_diff_limit(PPOFlowConfig.model_validate(truncated)) == FLOAT32_LIMIT
