"""The trainer's forward passes skip work whose outputs are discarded: same numbers and gradients as naive ones.

The naive computation here is written from scratch: feed the whole `cat(prompt, response)` (P + R columns)
with a plain `model(...)` call, take the logits at columns P-1 .. P+R-2, log_softmax / temperature and
gather the response tokens. policy_forward instead drops the last column, asks the LM head for the last
R columns only and runs the last layer's MLP on R columns. Float32, so the only differences are matmul
summation orders over different row counts: 1e-5 on log-probs of size ~|log 64| = 4, and on gradients.
Hooks on the model count the columns each part really saw, so a test also fails if a cut silently stops
happening (the numbers alone cannot tell).
"""

import contextlib

import pytest
import torch

from engines.models import load_critic, load_policy
from engines.trainer.forward import build_inputs, critic_forward, last_layer_mlp_on, policy_forward

TEMPERATURE = 0.7


def padded_batch(prompt_lengths, response_lengths, width_p, width_r, seed=0):
    """Left-padded prompts (B, P) and right-padded responses (B, R) of random tokens 3..63 (pad 0)."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(prompt_lengths)
    prompt_ids = torch.zeros(batch, width_p, dtype=torch.long)
    prompt_mask = torch.zeros(batch, width_p, dtype=torch.long)
    response_ids = torch.zeros(batch, width_r, dtype=torch.long)
    response_mask = torch.zeros(batch, width_r, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        prompt_ids[b, width_p - p :] = torch.randint(3, 64, (p,), generator=generator)
        prompt_mask[b, width_p - p :] = 1
        response_ids[b, :r] = torch.randint(3, 64, (r,), generator=generator)
        response_mask[b, :r] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


def naive_full_inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def naive_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask):
    ids, mask, positions = naive_full_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    width_p, width_r = prompt_ids.shape[1], response_ids.shape[1]
    scored = logits[:, width_p - 1 : width_p + width_r - 1].float() / TEMPERATURE
    return torch.log_softmax(scored, -1).gather(-1, response_ids[..., None]).squeeze(-1)


def naive_values(critic, prompt_ids, prompt_mask, response_ids, response_mask):
    ids, mask, positions = naive_full_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    values = critic(input_ids=ids, attention_mask=mask, position_ids=positions)
    width_p, width_r = prompt_ids.shape[1], response_ids.shape[1]
    return values[:, width_p - 1 : width_p + width_r - 1]


@contextlib.contextmanager
def columns_seen(**modules):
    """Within the block, record the column count (dim 1) of each named submodule's output, per call:
    yields {name: [columns, ...]}; the hooks are removed on exit.

    Registered before policy_forward's own hooks, so they run before its zero padding of the MLP output:
    they see the columns the module computed."""
    seen: dict = {}

    def hook(name):
        return lambda _m, _args, out: seen.setdefault(name, []).append(out.shape[1])

    handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def masked_weighted_sum(values, mask):
    # distinct weights per position, so a gradient landing on the wrong column shows up
    weights = torch.linspace(0.5, 1.5, values.numel()).reshape(values.shape)
    return (values * weights * mask).sum()


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def naive_with_grads(model, naive, batch, mask):
    """The naive outputs (detached) and the parameter gradients of their masked weighted sum; grads reset."""
    expected = naive(model, *batch)
    masked_weighted_sum(expected, mask).backward()
    expected_grads = grads(model)
    model.zero_grad(set_to_none=True)
    return expected.detach(), expected_grads


def assert_grads_close(model, expected_grads):
    actual = grads(model)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual[name], grad, atol=1e-5, rtol=1e-4, msg=name)


CASES = [
    # (prompt lengths, response lengths, P, R): ragged prompts and responses; R=1; one row
    ([3, 5, 1, 4], [6, 2, 6, 1], 5, 6),
    ([2, 2], [1, 1], 2, 1),
    ([4], [3], 4, 3),
]


@pytest.mark.parametrize("prompt_lengths,response_lengths,width_p,width_r", CASES)
def test_policy_forward_equals_naive_values_and_gradients(
    tiny_model_dir, prompt_lengths, response_lengths, width_p, width_r
):
    batch = padded_batch(prompt_lengths, response_lengths, width_p, width_r)
    mask = batch[3].float()
    model = load_policy(tiny_model_dir)
    expected, expected_grads = naive_with_grads(model, naive_logprobs, batch, mask)

    with columns_seen(
        first_mlp=model.model.layers[0].mlp, last_mlp=model.model.layers[-1].mlp, lm_head=model.lm_head
    ) as seen:
        out = policy_forward(model, *batch, TEMPERATURE, chunk_size=3)
    masked_weighted_sum(out.logprobs, mask).backward()

    assert seen == {"first_mlp": [width_p + width_r - 1], "last_mlp": [width_r], "lm_head": [width_r]}
    torch.testing.assert_close(out.logprobs * mask, expected * mask, atol=1e-5, rtol=0)
    assert grads(model).keys() == expected_grads.keys()
    assert_grads_close(model, expected_grads)


def test_critic_forward_equals_naive_values_and_gradients(tiny_model_dir):
    batch = padded_batch(*CASES[0])
    mask = batch[3].float()
    critic = load_critic(tiny_model_dir)
    expected, expected_grads = naive_with_grads(critic, naive_values, batch, mask)

    with columns_seen(last_mlp=critic.backbone.layers[-1].mlp) as seen:
        values = critic_forward(critic, *batch)
    masked_weighted_sum(values, mask).backward()

    assert seen == {"last_mlp": [CASES[0][3]]}
    torch.testing.assert_close(values * mask, expected * mask, atol=1e-6, rtol=0)
    assert_grads_close(critic, expected_grads)


def test_gradient_checkpointing_keeps_the_mlp_whole_and_the_result(tiny_model_dir):
    """Checkpointing recomputes the layer in the backward pass, outside the trim: the trim must stay off."""
    batch = padded_batch(*CASES[0])
    mask = batch[3].float()
    model = load_policy(tiny_model_dir)
    expected, expected_grads = naive_with_grads(model, naive_logprobs, batch, mask)
    model.gradient_checkpointing_enable()
    with last_layer_mlp_on(model, 2) as active:
        assert active is False
    out = policy_forward(model, *batch, TEMPERATURE)
    masked_weighted_sum(out.logprobs, mask).backward()
    torch.testing.assert_close(out.logprobs * mask, expected * mask, atol=1e-5, rtol=0)
    assert_grads_close(model, expected_grads)


def test_trim_is_off_for_families_not_known_to_be_position_wise(tiny_model_dir):
    model = load_policy(tiny_model_dir)
    with last_layer_mlp_on(model, 2) as active:
        assert active is True
    model.config.model_type = "mixtral"  # a mixture of experts: routing sees every token
    with last_layer_mlp_on(model, 2) as active:
        assert active is False
    # and the hooks are gone after the block: a plain call runs the MLP on every column
    with columns_seen(last_mlp=model.model.layers[-1].mlp) as seen:
        model(input_ids=torch.tensor([[1, 5, 6, 7]]), use_cache=False)
    assert seen == {"last_mlp": [4]}


def test_build_inputs_drops_the_last_response_column_and_rejects_empty_sides():
    prompt_ids, prompt_mask, response_ids, response_mask = padded_batch([2, 3], [3, 1], 3, 3)
    inputs = build_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    assert inputs.input_ids.tolist() == [
        prompt_ids[0].tolist() + response_ids[0, :2].tolist(),
        prompt_ids[1].tolist() + response_ids[1, :2].tolist(),
    ]
    # row 0: one left pad, then 2 prompt + 2 response tokens; row 1: 3 prompt tokens, 1 response token, pad
    assert inputs.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert inputs.position_ids.tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 3]]
    assert (inputs.prompt_width, inputs.response_width) == (3, 3)
    with pytest.raises(ValueError, match="prompt width 0"):
        build_inputs(prompt_ids[:, :0], prompt_mask[:, :0], response_ids, response_mask)
    with pytest.raises(ValueError, match="response width 0"):
        build_inputs(prompt_ids, prompt_mask, response_ids[:, :0], response_mask[:, :0])
