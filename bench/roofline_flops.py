"""The FLOP model of bench.roofline: how many floating-point operations each stage of an iteration performed.

Two ways, one per kind of stage:

1. **Counted** (score, update: torch code in this process). The stage's own function runs under
   torch.utils.flop_counter.FlopCounterMode on the iteration's real shards, so what is counted is what ran:
   the token-budget micro-batches and their padding, prompts shared by a group (engines/trainer/shared_prompt.py),
   the LM head only on the response columns, the old-log-prob pass when the trainer takes one, every epoch's
   forward and backward. Counted per executed operator: a (m, k) x (k, n) matmul is 2 m k n (mm, addmm, bmm,
   the backward's matmuls included); attention is 4 b h s_q s_k e forward (QK^T and AV over every key, causal
   or not: the CPU kernels compute the masked blocks too) and twice that backward. torch's counter has no
   formula for the CPU attention kernel (`_scaled_dot_product_flash_attention_for_cpu` and its backward);
   `ATTENTION_FORMULAS` gives them. Element-wise work (norms, activations, softmax, AdamW) is not counted:
   a roofline at the matmul peak is about the matmuls.
2. **Modelled** (rollout: vLLM runs in its own engine process, out of the counter's reach). From the rollout
   shard's token counts, for a Llama-shaped decoder (`Dims`, read from the policy's config.json):
   - each group's prompt (p tokens) is prefilled once (vLLM's prefix cache serves a group's other samples;
     where it recomputes a partial block per sample, the count is a lower bound): p tokens through every
     layer, causal attention sum_{i=1..p} 4 L H e i;
   - each sample's r response tokens: the first comes from the prefill's logits, the other r - 1 are decode
     steps, each one token through every layer attending to its p + t keys (paged attention reads only the
     real keys: 4 L H e (p + t));
   - the LM head (2 d V) once per sampled token, r per sample.
   Per token through the layers: 2 x (the q, k, v, o projections + gate, up, down) = `Dims.layer_matmul`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Dims:
    """The shape of a Llama-family decoder: L layers, hidden d, H query heads and G key/value heads of width e,
    MLP width f, vocabulary V."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "Dims":
        """From a Hugging Face folder's config.json. Raises KeyError naming a missing field."""
        config = json.loads((Path(path) / "config.json").read_text())
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
        )

    @property
    def layer_matmul(self) -> int:
        """Matmul FLOPs of one token through one decoder layer (forward): 2 x its projection weights."""
        d, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return 2 * (d * q + 2 * d * kv + q * d + 3 * d * f)

    def attention(self, keys: int) -> int:
        """Forward attention FLOPs of one query over `keys` keys in every layer: QK^T and AV, 2 x H e each."""
        return 4 * self.layers * self.heads * self.head_dim * keys

    @property
    def head(self) -> int:
        """The LM head's FLOPs for one position: 2 d V."""
        return 2 * self.hidden * self.vocab


def rollout_flops(dims: Dims, groups: Sequence[tuple[int, Sequence[int]]]) -> int:
    """Modelled FLOPs of sampling `groups`: each (prompt tokens p, [response tokens r of each sample]).

    Raises ValueError for a prompt of no tokens (nothing to prefill) or a negative response length."""
    total = 0
    for prompt, responses in groups:
        if prompt < 1:
            raise ValueError(f"a group's prompt has {prompt} tokens: at least 1 is prefilled")
        total += prompt * dims.layers * dims.layer_matmul + sum(dims.attention(i) for i in range(1, prompt + 1))
        for r in responses:
            if r < 0:
                raise ValueError(f"a sample has {r} response tokens")
            total += r * dims.head
            for t in range(1, r):  # decode step t feeds response token t and attends to p + t keys
                total += dims.layers * dims.layer_matmul + dims.attention(prompt + t)
    return total


def _cpu_attention_forward(query_shape, key_shape, *args, **kwargs) -> int:
    batch, heads, s_q, e = query_shape
    return 4 * batch * heads * s_q * key_shape[2] * e


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, *args, **kwargs) -> int:
    return 2 * _cpu_attention_forward(query_shape, key_shape)


def attention_formulas() -> dict:
    """FlopCounterMode's custom_mapping for the CPU attention kernels torch's counter leaves at 0."""
    import torch

    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
    }


def counted_flops(run: Callable[[], Any]) -> tuple[Any, int]:
    """(run()'s result, the matmul and attention FLOPs it executed), counted by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=attention_formulas()) as counter:
        result = run()
    return result, int(counter.get_total_flops())
