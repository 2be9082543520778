"""Forward passes over concatenated prompt + response: response-token log-probs (actor) and values (critic).

Layout: the prompt is left-padded to P columns and the response right-padded to R columns (see
experience.py), so the input is `cat(prompt_ids, response_ids[:, :-1])` of shape (B, P + R - 1), its
attention mask the same cut of `cat(prompt_mask, response_mask)`, and position ids count only real tokens
(cumsum(mask) - 1), so a left-padded prompt gets exactly the positions it would have alone (what the
sampler saw).

Response token t sits at column P + t and is predicted by the logits at column P + t - 1. So the response
log-probs are `selective_log_softmax(logits[:, P-1 : P+R-1], response_ids, temperature)`, and a critic's
values for the response tokens are taken at the same columns: the value of the state just before token t
is emitted (OpenRLHF's convention). Those are the last R columns of the input.

Work that cannot change those outputs is not done (each cut is exact: same numbers, same gradients):
- the last response token is not fed: it predicts nothing that is scored, and in a causal model no
  earlier column sees it (one column of P + R);
- the LM head runs on the last R columns only (`logits_to_keep`): with a real vocabulary (32k-150k
  words) the head is a large share of a small model's FLOPs and its (B, P + R, V) logits of the memory;
- the last decoder layer's MLP runs on the last R columns only (`last_layer_mlp_on`): after the last
  layer nothing mixes columns, so the other columns' final hidden states feed only logits and values
  that are thrown away. Only for dense decoder families whose layers' `mlp` is position-wise
  (`_TRIMMED_MLP_FAMILIES`), and not under gradient checkpointing (its recomputation in the backward
  pass would run the MLP untrimmed).
- rows that share a prompt (a GRPO group) run its columns once (`shared_prompt.py`: one packed sequence of
  the distinct prompts and every row's response, with attention per segment).
Measured on the peer bench's 10M Llama (P=6, R=8, bf16 autocast, one core): forward + backward 0.85x
the untrimmed pass.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator, NamedTuple, Optional

import torch
from torch import nn

from engines.ppo.logprobs import entropy_from_logits, selective_log_softmax, selective_log_softmax_and_entropy
from engines.trainer.shared_prompt import shared_prompt_logits, sharing

# Model families whose decoder layers have a position-wise `mlp` (dense SwiGLU), so the last layer's MLP can
# skip columns whose outputs are discarded. Mixture-of-experts layers are not position-wise in training
# (routing capacity and the load-balancing loss see every token) and are left out on purpose.
_TRIMMED_MLP_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class ModelInputs(NamedTuple):
    """input_ids, attention_mask, position_ids: each (B, P + R - 1); prompt_width: P; response_width: R."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_width: int
    response_width: int


def build_inputs(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> ModelInputs:
    """Left-padded prompts (B, P) and right-padded responses (B, R) -> one (B, P + R - 1) forward input.

    Raises ValueError when P or R is 0 (no column predicts the first response token, or nothing to score).
    """
    width_p, width_r = prompt_ids.shape[1], response_ids.shape[1]
    if width_p == 0 or width_r == 0:
        raise ValueError(
            f"a forward pass needs at least one prompt and one response column; got prompt "
            f"width {width_p} and response width {width_r}"
        )
    input_ids = torch.cat([prompt_ids, response_ids[:, :-1]], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), response_mask[:, :-1].long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return ModelInputs(input_ids, attention_mask, position_ids, width_p, width_r)


def _unwrap(model) -> nn.Module:
    """The nn.Module behind a DeepSpeed engine (`.module`), a ValueHeadModel (`.backbone`) or a peft LoRA
    model (`get_base_model()`, which forwards `logits_to_keep` and holds the decoder layers)."""
    model = getattr(model, "module", model)
    model = getattr(model, "backbone", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _last_layer_mlp(model) -> Optional[nn.Module]:
    """The last decoder layer's MLP when trimming it is exact (see the module docstring), else None."""
    base = _unwrap(model)
    config = getattr(base, "config", None)
    if getattr(config, "model_type", None) not in _TRIMMED_MLP_FAMILIES:
        return None
    if getattr(base, "is_gradient_checkpointing", False):
        return None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    layers = getattr(decoder, "layers", None)
    if not layers:
        return None
    mlp = getattr(layers[-1], "mlp", None)
    return mlp if isinstance(mlp, nn.Module) else None


@contextlib.contextmanager
def last_layer_mlp_on(model, columns: int) -> Iterator[bool]:
    """Within the block, the last decoder layer's MLP computes only the last `columns` columns of (B, T, H).

    The other columns get a zero MLP output, so their final hidden states are wrong and must be discarded
    (policy_forward and critic_forward keep only the last R columns). Yields whether the trim is active
    (False for families not in `_TRIMMED_MLP_FAMILIES`, under gradient checkpointing, or without a
    `layers[-1].mlp`); the hooks are gone after the block, so the backward pass may run outside it.
    """
    mlp = _last_layer_mlp(model)
    if mlp is None:
        yield False
        return
    widths: list[int] = []

    def keep_last(_module, args):
        if not args or args[0].dim() != 3:  # called in a way this trim does not know: leave it whole
            widths.append(None)
            return None
        widths.append(args[0].shape[1])
        return (args[0][:, -columns:], *args[1:]) if args[0].shape[1] > columns else None

    def pad_front(_module, _args, out):
        width = widths.pop()
        if width is None or out.shape[1] == width:
            return None
        return torch.cat([out.new_zeros(out.shape[0], width - out.shape[1], out.shape[2]), out], dim=1)

    handles = [mlp.register_forward_pre_hook(keep_last), mlp.register_forward_hook(pad_front)]
    try:
        yield True
    finally:
        for handle in handles:
            handle.remove()


def _takes_logits_to_keep(model) -> bool:
    return _class_takes_logits_to_keep(type(_unwrap(model)))


@functools.lru_cache(maxsize=None)
def _class_takes_logits_to_keep(model_class: type) -> bool:
    """Whether `model_class.forward` has a `logits_to_keep` argument (read once per class: this is per forward)."""
    try:
        return "logits_to_keep" in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return False


class PolicyOutput(NamedTuple):
    """logprobs: (B, R) log pi(response token) at the temperature. entropy: (B, R) or None."""

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]


def policy_forward(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    chunk_size: int = 256,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> PolicyOutput:
    """Log-probs (B, R) of the response tokens under a causal LM; padding positions hold junk (mask them).

    with_entropy: also return the entropy (B, R) of the sampling distribution at each response position;
    it carries a gradient only with entropy_grad (an entropy bonus), else it is a detached metric.
    """
    inputs = build_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    width_r = inputs.response_width
    base = _unwrap(model)
    shared = sharing(model, base, prompt_ids, prompt_mask, width_r) if _takes_logits_to_keep(model) else None
    if shared is not None:  # rows with the same prompt: its columns run once (shared_prompt.py)
        logits = shared_prompt_logits(model, base.config, shared, *inputs)
    else:
        extra = {"logits_to_keep": width_r} if _takes_logits_to_keep(model) else {}
        with last_layer_mlp_on(model, width_r):
            out = model(
                input_ids=inputs.input_ids,
                attention_mask=inputs.attention_mask,
                position_ids=inputs.position_ids,
                use_cache=False,
                **extra,
            )
        logits = out.logits
        if logits.shape[1] != width_r:  # a model without logits_to_keep: every column's logits came back
            logits = logits[:, -width_r:]  # (a slice's backward allocates a zero gradient for every column)
    if with_entropy and not entropy_grad:
        # the entropy metric from the log-probs' own pass; then nothing else saves the logits, so the log-probs'
        # backward writes its (B, R, V) gradient over them instead of into a new tensor
        logprobs, entropy = selective_log_softmax_and_entropy(
            logits, response_ids, temperature, chunk_size, inplace_backward=True
        )
        return PolicyOutput(logprobs, entropy)
    logprobs = selective_log_softmax(logits, response_ids, temperature, chunk_size)
    entropy = entropy_from_logits(logits, temperature, chunk_size) if with_entropy else None  # an entropy bonus
    return PolicyOutput(logprobs, entropy)


def critic_forward(
    critic, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Values (B, R): the critic's value of the state before each response token (float32)."""
    inputs = build_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    with last_layer_mlp_on(critic, inputs.response_width):
        values = critic(
            input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids
        )
    return values[:, -inputs.response_width :]
