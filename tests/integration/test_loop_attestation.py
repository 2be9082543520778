"""The bare engine loop (stages/loop.py) attests its engine through the rollout stage's own engine step: a policy
folder replaced between the loop's save and vLLM's load, and an in-memory sync that never reached the HF engine, each
fail the next iteration's rollout with AttestationError naming the iteration and the versions; a loop left alone
records timing/attest. Without the attestation both sabotaged iterations return metrics (checked by disabling it)."""

from __future__ import annotations

import pytest

from engines.rollout.registry import shutdown_all
from stages.attest import AttestationError
from stages.loop import EngineLoop
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

VLLM = {"engine": "vllm", "kv_cache_space_gib": 0.25, "max_model_len": 256}


@pytest.fixture(autouse=True)
def _engines_shut_down():
    yield
    shutdown_all()


def test_a_sync_that_never_reached_the_hf_engine_fails_the_next_iteration(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    from engines.rollout.hf import HFRolloutEngine

    cfg = small_config(str(tmp_path / "runs"), "loop-hf", tiny_model_dir, digits_dataset_dir)
    loop = EngineLoop(cfg, work_dir=str(tmp_path / "loop"))
    # the engine keeps its weights when handed the actor's: a handover that silently did nothing
    monkeypatch.setattr(HFRolloutEngine, "load_state_dict", lambda self, weights, version: None)
    try:
        assert loop.run_iteration(1)["timing/attest"] > 0  # the initial model, attested; then policy 1 "synced"
        with pytest.raises(AttestationError) as failed:
            loop.run_iteration(2)
    finally:
        loop.shutdown()
    message = str(failed.value)
    assert message.startswith("rollout stage of iteration 2: the hf engine does not serve the policy it was handed")
    assert "expected policy version 1 (loop-1-" in message and "policy version 0's weights" in message


def test_a_policy_folder_swapped_before_vllm_loads_it_fails_the_next_iteration(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    from safetensors.torch import load_file, save_file

    from engines.rollout.vllm_engine import VLLMRolloutEngine

    pytest.importorskip("vllm")
    cfg = small_config(str(tmp_path / "runs"), "loop-vllm", tiny_model_dir, digits_dataset_dir, rollout=VLLM)
    original = VLLMRolloutEngine.load_weights

    def swapped_then_loaded(self, policy_dir, version):
        # same path, other weights: the folder the loop saved, one weight changed after its record was taken
        weights = f"{policy_dir}/model.safetensors"
        tensors = load_file(weights)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5
        save_file(tensors, weights, metadata={"format": "pt"})
        original(self, policy_dir, version)

    monkeypatch.setattr(VLLMRolloutEngine, "load_weights", swapped_then_loaded)
    loop = EngineLoop(cfg, work_dir=str(tmp_path / "loop"))
    try:
        loop.run_iteration(1)  # samples with the initial model, then saves policy 1 and vLLM loads the swapped folder
        with pytest.raises(AttestationError) as failed:
            loop.run_iteration(2)
    finally:
        loop.shutdown()
    message = str(failed.value)
    assert message.startswith("rollout stage of iteration 2: the vllm engine does not serve the policy it was handed")
    assert "expected policy version 1 (loop-1-" in message
    assert "weights of no policy this process attested" in message
