"""The train/inference mismatch gate on a real update (HF sampler, DeepSpeed trainer, tiny model): measured every
iteration with either source of old log-probs, and a sampler whose log-probs are off fails the update by name
before anything is staged."""

from __future__ import annotations

import pytest

from stages.mismatch_gate import MismatchError
from stages.policy import policy_ref
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
