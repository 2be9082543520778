"""The train/inference mismatch gate on a real update (HF sampler, DeepSpeed trainer, tiny model): measured every
iteration with either source of old log-probs, and a sampler whose log-probs are off fails the update by name
before anything is staged; rows sampled by an older policy (pipeline.max_staleness) are compared with that policy."""

from __future__ import annotations

import pytest

from stages.checkpoint import run_checkpoint
from stages.mismatch_gate import MismatchError
from stages.policy import behaviour_policy_ref, policy_ref
from stages.rollout import run_rollout
from stages.score import run_score
from stages.update import run_update
from storage.checkpoints import is_committed
from storage.layout import layout_for
from tests.fixtures.faults import offset_sampler_logprobs
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

# recompute in one micro-batch: the trainer's side is the first epoch's own forward; rollout in two micro-batches:
# the forwards of the update's first optimizer step (engines/trainer/mismatch.py), no forward of its own
CASES = {"recompute": {"micro_batch_size": 16}, "rollout": {"micro_batch_size": 8}}


@pytest.mark.parametrize("old_logprobs", sorted(CASES))
def test_the_gap_is_measured_and_a_sampler_off_by_0_01_nats_fails_the_update(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch, old_logprobs
):
    cfg = small_config(
        str(tmp_path / "runs"),
        f"gate-{old_logprobs}",
        tiny_model_dir,
        digits_dataset_dir,
        algo={"name": "grpo", "old_logprobs": old_logprobs},
        train=CASES[old_logprobs],
    )
    policy = policy_ref(cfg, 1)
    scored = run_score(cfg, 1, run_rollout(cfg, 1, policy))
    metrics = run_update(cfg, 1, policy, scored).metrics
    # the same weights in float32: rounding only (measured ~1e-7 mean, 5e-7 max on this model)
    assert 0 <= metrics["mismatch/logprob_abs_diff_mean"] < 1e-5 and metrics["mismatch/logprob_abs_diff_max"] < 1e-4
    assert metrics["mismatch/tokens"] > 0

    offset_sampler_logprobs(monkeypatch, 0.01)
    scored = run_score(cfg, 2, run_rollout(cfg, 2, policy_ref(cfg, 1)))  # iteration 2's rows, sampled off by 0.01
    with pytest.raises(MismatchError) as failed:
        run_update(cfg, 2, policy_ref(cfg, 1), scored)
    # every policy token is 0.01 off: the mean is 0.01 to rounding
    assert str(failed.value).startswith("update stage of iteration 2: mismatch/logprob_abs_diff_mean = 0.01 is over")
    assert not is_committed(layout_for(cfg), 2)
    assert not layout_for(cfg).fs.exists(layout_for(cfg).checkpoint_dir(2))  # nothing staged either


def test_stale_rows_are_compared_with_their_own_behaviour_policy(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    # pipeline.max_staleness = 1: iteration 2 samples with the initial model (version 0) and trains from checkpoint 1
    cfg = small_config(
        str(tmp_path / "runs"), "gate-stale", tiny_model_dir, digits_dataset_dir, pipeline={"max_staleness": 1}
    )
    first = policy_ref(cfg, 1)
    run_checkpoint(cfg, 1, run_update(cfg, 1, first, run_score(cfg, 1, run_rollout(cfg, 1, first))))
    stale = run_score(cfg, 2, run_rollout(cfg, 2, behaviour_policy_ref(cfg, 2)))
    metrics = run_update(cfg, 2, policy_ref(cfg, 2), stale).metrics
    rows = 8 * 2  # rollout.prompts_per_iteration x n_samples (SMALL), every one sampled by version 0
    assert metrics["mismatch/off_policy_rows"] == rows and metrics["async/staleness"] == 1
    # Against their own policy the HF sampler and the trainer's forward agree to float32 rounding, although the
    # trainer's weights moved (lr 1e-3): compared with checkpoint 1 they would differ by the update itself.
    assert 0 <= metrics["mismatch/logprob_abs_diff_mean"] < 1e-5 and metrics["mismatch/tokens"] > 0
    moved = _gap_to_policy(cfg, policy_ref(cfg, 2), layout_for(cfg).stage_dir(2, "scored"))
    assert moved > 100 * max(metrics["mismatch/logprob_abs_diff_mean"], 1e-8)

    # A second, independent derivation: a sampler that reports every token 0.01 nats off gives a mean gap of 0.01
    # (|d| = 0.01 on each token, rounding aside) against the behaviour policy, and the gate fails by name.
    offset_sampler_logprobs(monkeypatch, 0.01)
    off = run_score(cfg, 2, run_rollout(cfg, 2, behaviour_policy_ref(cfg, 2)))
    with pytest.raises(MismatchError) as failed:
        run_update(cfg, 2, policy_ref(cfg, 2), off)
    message = str(failed.value)
    assert message.startswith("update stage of iteration 2: mismatch/logprob_abs_diff_mean = 0.01 is over")
    assert "(policy version 0)" in message


def _gap_to_policy(cfg, policy, scored_dir: str) -> float:
    """Mean |log-prob gap| of the scored rows' sampler log-probs to `policy`'s (the trainer's starting weights):
    what the gate would have measured had it compared stale rows with the current policy."""
    import pyarrow.compute as pc
    import torch

    from engines.scoring.reference import ReferenceModel
    from stages.policy import local_policy_dir
    from storage.shards import read_shards

    rows = read_shards(layout_for(cfg).fs, scored_dir)
    model = ReferenceModel(local_policy_dir(cfg, policy), temperature=cfg.rollout.temperature)
    trainer = model.logprobs(rows.column("prompt_ids").to_pylist(), rows.column("response_ids").to_pylist())
    sampler = rows.column("rollout_logprobs").to_pylist()
    gaps = torch.cat([(torch.tensor(t) - torch.tensor(s)).abs() for t, s in zip(trainer, sampler)])
    assert pc.min(rows.column("policy_version")).as_py() == 0
    return float(gaps.mean())
