"""Rows that share a prompt run its columns once: same log-probs and gradients as the naive whole-row forward.

The naive side is test_forward_trim's: the whole `cat(prompt, response)` through a plain `model(...)` call.
The batch below holds groups (rows with equal prompts), one group split over non-adjacent rows, a prompt of
one token among longer left-padded ones, and two prompts equal in their real tokens but padded with different
ids (padding is not part of a prompt). Hooks count the rows and columns the first decoder layer saw, so a
test also fails if the sharing silently stops (the numbers alone cannot tell). Besides the toy model: grouped
query heads (SmolLM2's 9 query heads share 3 key/value heads), prompts of one token each (no prefix at all),
and a sliding window shorter than a row (the packed attention does not apply one: the plain forward runs).
"""

import torch

from engines.models import load_policy
from engines.trainer.forward import policy_forward
from engines.trainer.shared_prompt import distinct_prompts, sharing
from tests.unit.test_forward_trim import (
    TEMPERATURE,
    assert_grads_close,
    grads,
    masked_weighted_sum,
    naive_full_inputs,
    naive_logprobs,
    naive_with_grads,
)

P, R = 5, 4
# (prompt tokens, response tokens); prompts A, B, C (one token), D written twice with other padding ids
A, B, C, D = [7, 8, 9, 10], [11, 12, 13, 14, 15], [16], [17, 18]
ROWS = [
    (A, [20, 21, 22]),
    (A, [23, 24, 25, 26]),
    (A, [27]),
    (B, [28, 29, 30, 31]),
    (B, [32, 33]),
    (C, [34, 35]),
    (A, [36, 37, 38]),  # A again, after other prompts
    (D, [39, 40, 41, 42]),
    (D, [43]),
]


def shared_batch(pad_ids=(0, 0, 0, 0, 0, 0, 0, 0, 5)):
    """Left-padded prompts (9, P) and right-padded responses (9, R); row b's prompt padding holds pad_ids[b]."""
    batch = len(ROWS)
    prompt_ids = torch.zeros(batch, P, dtype=torch.long)
    prompt_mask = torch.zeros(batch, P, dtype=torch.long)
    response_ids = torch.zeros(batch, R, dtype=torch.long)
    response_mask = torch.zeros(batch, R, dtype=torch.long)
    for b, (prompt, response) in enumerate(ROWS):
        prompt_ids[b] = pad_ids[b]
        prompt_ids[b, P - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[b, P - len(prompt) :] = 1
        response_ids[b, : len(response)] = torch.tensor(response)
        response_mask[b, : len(response)] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


def test_distinct_prompts_numbers_them_in_order_of_first_row_and_ignores_padding():
    prompt_ids, prompt_mask, _, _ = shared_batch()
    shared = distinct_prompts(prompt_ids, prompt_mask)
    # by hand: A first at row 0, B at 3, C at 5, D at 7 (rows 7 and 8 differ only in their padding ids)
    assert shared.first.tolist() == [0, 3, 5, 7]
    assert shared.inverse.tolist() == [0, 0, 0, 1, 1, 2, 0, 3, 3]


def test_shared_forward_equals_the_naive_one_in_values_and_gradients(tiny_model_dir):
    batch = shared_batch()
    mask = batch[3].float()
    model = load_policy(tiny_model_dir)
    expected, expected_grads = naive_with_grads(model, naive_logprobs, batch, mask)
    seen = []
    hook = model.model.layers[0].mlp.register_forward_hook(lambda _m, _a, out: seen.append(tuple(out.shape[:2])))
    try:
        out = policy_forward(model, *batch, TEMPERATURE, chunk_size=3, with_entropy=True)
    finally:
        hook.remove()
    masked_weighted_sum(out.logprobs, mask).backward()

    # one packed sequence: the real prefix tokens of the 4 distinct prompts (A: 3, B: 4, C: 0, D: 1; every
    # prompt token but the last), then all 9 rows x R columns (last prompt token + R - 1 response tokens)
    assert seen == [(1, 3 + 4 + 0 + 1 + 9 * R)]
    torch.testing.assert_close(out.logprobs * mask, expected * mask, atol=1e-5, rtol=0)
    assert grads(model).keys() == expected_grads.keys()
    assert_grads_close(model, expected_grads)


def test_the_plain_forward_runs_where_sharing_does_not_apply(tiny_model_dir):
    prompt_ids, prompt_mask, _, _ = shared_batch()
    model = load_policy(tiny_model_dir)
    assert sharing(model, model, prompt_ids, prompt_mask) is not None
    # every prompt distinct: nothing to share
    assert sharing(model, model, prompt_ids[[0, 3, 5, 7]], prompt_mask[[0, 3, 5, 7]]) is None
    # one prompt column: no prefix to cache
    assert sharing(model, model, prompt_ids[:, -1:], prompt_mask[:, -1:]) is None
    # under gradient checkpointing Transformers turns the cache off in training
    model.gradient_checkpointing_enable()
    assert sharing(model, model, prompt_ids, prompt_mask) is None
    model.gradient_checkpointing_disable()
    model.config.model_type = "gpt2"  # a family whose attention the packed call is not known to reach
    assert sharing(model, model, prompt_ids, prompt_mask) is None


def _equal_to_the_naive_forward(model, batch):
    mask = batch[3].float()
    expected, expected_grads = naive_with_grads(model, naive_logprobs, batch, mask)
    out = policy_forward(model, *batch, TEMPERATURE, chunk_size=3)
    masked_weighted_sum(out.logprobs, mask).backward()
    torch.testing.assert_close(out.logprobs * mask, expected * mask, atol=1e-5, rtol=0)
    assert_grads_close(model, expected_grads)


def _gqa_llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
        **extra,
    )
    return LlamaForCausalLM(config)


def test_grouped_query_heads_give_the_naive_values_and_gradients():
    model = _gqa_llama()
    batch = shared_batch()
    assert sharing(model, model, batch[0], batch[1], R) is not None
    _equal_to_the_naive_forward(model, batch)


def test_prompts_of_one_token_have_no_prefix_and_still_give_the_naive_values(tiny_model_dir):
    rows = [([16], [20, 21]), ([16], [22, 23, 24]), ([19], [25]), ([19], [26, 27])]
    batch = [torch.zeros(len(rows), width, dtype=torch.long) for width in (P, P, R, R)]
    for b, (prompt, response) in enumerate(rows):
        batch[0][b, -1], batch[1][b, -1] = prompt[0], 1
        batch[2][b, : len(response)] = torch.tensor(response)
        batch[3][b, : len(response)] = 1
    model = load_policy(tiny_model_dir)
    assert sharing(model, model, batch[0], batch[1], R) is not None
    _equal_to_the_naive_forward(model, batch)


def test_a_sliding_window_shorter_than_a_row_keeps_the_plain_forward():
    prompt_ids, prompt_mask, _, _ = shared_batch()
    model = _gqa_llama()
    model.config.model_type = "mistral"  # a family whose attention may slide
    model.config.sliding_window = P + R - 1  # a row is P + R - 1 tokens: the window never binds
    assert sharing(model, model, prompt_ids, prompt_mask, R) is not None
    model.config.sliding_window = P + R - 2
    assert sharing(model, model, prompt_ids, prompt_mask, R) is None
    model.config.use_sliding_window = False  # Qwen2/3 carry a window they do not use
    assert sharing(model, model, prompt_ids, prompt_mask, R) is not None


def naive_entropy(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """The sampling distribution's entropy (B, R) at each response position, from the naive whole-row logits."""
    ids, mask, positions = naive_full_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    width_p, width_r = prompt_ids.shape[1], response_ids.shape[1]
    scored = logits[:, width_p - 1 : width_p + width_r - 1].float() / TEMPERATURE
    return -(scored.softmax(-1) * scored.log_softmax(-1)).sum(-1)


def test_entropy_metric_and_entropy_bonus_equal_the_naive_ones(tiny_model_dir):
    # the metric (no gradient: computed in the log-probs' pass, their backward in place over the logits) and the
    # bonus (a gradient through the entropy too: a separate pass, not in place) on the shared batch
    batch = shared_batch()
    mask = batch[3].float()
    model = load_policy(tiny_model_dir)
    naive_both = lambda m, *b: naive_logprobs(m, *b) + naive_entropy(m, *b)  # noqa: E731
    _, expected_grads = naive_with_grads(model, naive_both, batch, mask)
    expected_entropy = naive_entropy(model, *batch).detach()

    metric = policy_forward(model, *batch, TEMPERATURE, chunk_size=3, with_entropy=True)
    assert not metric.entropy.requires_grad
    torch.testing.assert_close(metric.entropy * mask, expected_entropy * mask, atol=1e-5, rtol=0)
    model.zero_grad(set_to_none=True)

    bonus = policy_forward(model, *batch, TEMPERATURE, chunk_size=3, with_entropy=True, entropy_grad=True)
    masked_weighted_sum(bonus.logprobs + bonus.entropy, mask).backward()
    torch.testing.assert_close(bonus.entropy * mask, expected_entropy * mask, atol=1e-5, rtol=0)
    assert_grads_close(model, expected_grads)
