"""Model FLOPs of the update bench (bench/update_mfu.py, whose docstring states the convention), the model sizes
it runs, and the GPUs' dense bfloat16 peaks. Pure arithmetic: tested against hand derivations
(tests/unit/test_update_mfu.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int


SIZES = {
    # ~0.47B parameters: 24 layers x 16.8M + untied embedding and LM head of 32000 x 1024 each.
    "0.5b": ModelSize(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096, vocab_size=32000),
    # the peer benchmark's small Llama (bench/peer_trl.py), for a CPU run of the same code path
    "tiny": ModelSize(hidden_size=512, num_layers=3, num_heads=8, intermediate_size=1536, vocab_size=64),
}


def layer_params(size: ModelSize) -> int:
    """Parameters of one Llama decoder layer: q, k, v, o (d x d each, no bias), gate/up/down MLP, two RMSNorms."""
    d, f = size.hidden_size, size.intermediate_size
    return 4 * d * d + 3 * d * f + 2 * d


def update_flops(
    size: ModelSize,
    batch: int,
    prompt_len: int,
    response_len: int,
    epochs: int,
    old_from_first_forward: bool,
    with_critic: bool = True,
) -> float:
    """Model FLOPs of one update, the convention of bench/update_mfu.py's docstring: actor and critic (PPO), or
    the actor alone with `with_critic=False` (GRPO, RLOO, REINFORCE++)."""
    seq = prompt_len + response_len - 1
    tokens = batch * seq
    d, f = size.hidden_size, size.intermediate_size
    body = (
        6 * size.num_layers * layer_params(size) * tokens
        + 12 * size.num_layers * d * seq * tokens
        - 6 * 3 * d * f * batch * (seq - response_len)
    )  # last layer's MLP: response columns only
    head = 6 * d * size.vocab_size * batch * response_len
    train_pass = (body + head) + (body if with_critic else 0)  # actor, critic
    extra_forward = 0 if old_from_first_forward else train_pass / 3  # a forward is a third of forward+backward
    return epochs * train_pass + extra_forward


def plain_step_flops(size: ModelSize, batch: int, seq: int) -> float:
    """Model FLOPs of one causal-LM training step of the actor: every position through the LM head."""
    tokens = batch * seq
    return (
        6 * size.num_layers * layer_params(size) * tokens
        + 12 * size.num_layers * size.hidden_size * seq * tokens
        + 6 * size.hidden_size * size.vocab_size * tokens
    )


def peak_flops(device: str) -> Optional[float]:
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
