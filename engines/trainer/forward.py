"""Forward passes over concatenated prompt + response: response-token log-probs (actor) and values (critic).

Layout: the prompt is left-padded to P columns and the response right-padded to R columns (see
experience.py), so the input is `cat(prompt_ids, response_ids)` of shape (B, P + R), its attention mask is
`cat(prompt_mask, response_mask)`, and position ids count only real tokens (cumsum(mask) - 1), so a
left-padded prompt gets exactly the positions it would have alone (what the sampler saw).

Response token t sits at column P + t and is predicted by the logits at column P + t - 1. So the response
log-probs are `selective_log_softmax(logits[:, P-1 : P+R-1], response_ids, temperature)` and a critic's
values for the response tokens are taken at the same columns: the value of the state just before token t
is emitted (OpenRLHF's convention).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from engines.ppo.logprobs import entropy_from_logits, selective_log_softmax


class ModelInputs(NamedTuple):
    """input_ids, attention_mask, position_ids: each (B, P + R); prompt_width: P."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_width: int


def build_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                 response_mask: torch.Tensor) -> ModelInputs:
    """Concatenate left-padded prompts (B, P) and right-padded responses (B, R) for one forward pass."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return ModelInputs(input_ids, attention_mask, position_ids, prompt_ids.shape[1])


class PolicyOutput(NamedTuple):
    """logprobs: (B, R) log pi(response token) at the temperature. entropy: (B, R) or None."""

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]


def policy_forward(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                   response_mask: torch.Tensor, temperature: float, chunk_size: int = 256,
                   with_entropy: bool = False, entropy_grad: bool = False) -> PolicyOutput:
    """Log-probs (B, R) of the response tokens under a causal LM; padding positions hold junk (mask them).

    with_entropy: also return the entropy (B, R) of the sampling distribution at each response position;
    it carries a gradient only with entropy_grad (an entropy bonus), else it is a detached metric.
    """
    inputs = build_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    out = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                position_ids=inputs.position_ids, use_cache=False)
    width_p, width_r = inputs.prompt_width, response_ids.shape[1]
    logits = out.logits[:, width_p - 1: width_p + width_r - 1]
    logprobs = selective_log_softmax(logits, response_ids, temperature, chunk_size)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature, chunk_size)
    return PolicyOutput(logprobs, entropy)


def critic_forward(critic, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                   response_mask: torch.Tensor) -> torch.Tensor:
    """Values (B, R): the critic's value of the state before each response token (float32)."""
    inputs = build_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    values = critic(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                    position_ids=inputs.position_ids)
    width_p, width_r = inputs.prompt_width, response_ids.shape[1]
    return values[:, width_p - 1: width_p + width_r - 1]
