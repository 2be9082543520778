"""vLLM's in-place reload of a model whose LM head is its input embedding (adaptations/vllm.py).

A module of its own: the engine it starts and shuts down must be the only one of this process (VLLMRolloutEngine
.shutdown reaps every child process, so it would take test_vllm_rollout's module engine with it).
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


def test_a_tied_head_samples_the_reloaded_weights(tmp_path):
    """A model whose LM head is its input embedding (tie_word_embeddings, as SmolLM2): after load_weights, vLLM
    0.32 kept the head's old kernel (adaptations/vllm.py), so the sampler's log-probs matched
    neither folder; they must be a transformers forward of the new folder's."""
    from transformers import LlamaForCausalLM

    from engines.rollout.vllm_engine import VLLMRolloutEngine
    from engines.toy.model import ToyShape, build_toy_model

    tied = build_toy_model(LlamaForCausalLM, tmp_path / "tied", ToyShape(), seed=1, tie_word_embeddings=True)
    moved = shutil.copytree(tied, tmp_path / "tied-moved")
    weights = load_file(str(moved / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied: the head is the embedding
    generator = torch.Generator().manual_seed(0)
    embedding = weights["model.embed_tokens.weight"]
    embedding += 0.5 * torch.randn(embedding.shape, generator=generator)
    save_file(weights, str(moved / "model.safetensors"), metadata={"format": "pt"})
    engine = VLLMRolloutEngine(str(tied), seed=0, kv_cache_space_gib=0.25, max_model_len=256)
    try:
        engine.load_weights(str(moved), 1)
        samples = engine.generate(PROMPTS, SamplingSettings(n=2, max_new_tokens=8), seeds=[5, 6, 7])
    finally:
        engine.shutdown()
    assert _worst_logprob_gap(samples, moved) < 2e-5
    assert _worst_logprob_gap(samples, tied) > 1e-2  # the move is large enough to tell the two apart
