"""One forward pass per micro-batch in which rows that share a prompt (a GRPO group's samples) run its tokens once.

In a causal model a prompt's hidden states do not depend on what follows it, so the G samples of a group
compute the same keys and values over their common prompt G times in a plain batched forward. Here the
micro-batch runs as one packed sequence of N tokens, with no padding anywhere:

    prefix  the U distinct prompts' real tokens but the last, one after another     (sum of their lengths)
    suffix  every row's cat(last prompt token, response_ids[:, :-1])                 (B x R; all R logits scored)

Every linear layer, norm and the embedding run once over the N tokens (one matrix multiply of N rows where
two calls ran U x (P - 1) and B x R rows: larger products run nearer the matmul peak, and each weight's
gradient is one product, not the sum of two). Attention is the only part that mixes tokens, so it runs per
segment (`packed_attention`, registered with Transformers' attention functions for the call): the prefixes
as U causal sequences, and each row's suffix against its prompt's prefix keys and values (gathered: the
gather's backward sums the rows' gradients into their prompt's) and its own earlier suffix tokens. Position
ids are the whole row's (`forward.build_inputs`), so each row sees what it would see in one (B, P + R - 1)
forward: the same numbers up to summation order (float32: ~2e-5 on log-probs) and the same gradients.

When it applies (`sharing`): at least two rows share a prompt, P >= 2, the model is a dense decoder family
whose attention goes through Transformers' attention-function table with the call's keyword arguments
(`_FAMILIES`), no sliding window shorter than a row, and gradient checkpointing off (its recomputation in
the backward pass would run after the call has switched the attention function back: plain causal attention
over the packed sequence, the wrong gradients). Otherwise the plain forward runs; the outputs are the same
either way, so this is a speed choice only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_ATTENTION = "ppoflow_packed_prompts"  # the name packed_attention is registered under


class PromptSharing(NamedTuple):
    """first: (U,) the row of each distinct prompt's first occurrence; inverse: (B,) each row's prompt in 0..U-1."""

    first: torch.Tensor
    inverse: torch.Tensor


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> PromptSharing:
    """The distinct rows of the left-padded prompts (B, P): equal tokens at the real positions (padding ignored)."""
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(key), device=key.device)
    count = int(inverse.max()) + 1
    first = torch.full((count,), len(key), dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    # number the prompts in order of first appearance, so the prefixes are packed in the rows' order
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(count, device=key.device)
    return PromptSharing(first[order], rank[inverse])


def _window_binds(config, row_width: int) -> bool:
    """Whether a sliding attention window shorter than a row is in use (packed_attention attends to the whole row)."""
    if not getattr(config, "use_sliding_window", True):  # Qwen2/3 carry a window size they do not use by default
        return False
    window = getattr(config, "sliding_window", None)
    return window is not None and window < row_width


def sharing(
    model, base, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_width: int = 1
) -> Optional[PromptSharing]:
    """The prompt sharing of this batch when the packed forward applies (module docstring), else None.

    base: the nn.Module behind the wrappers (forward._unwrap), for its config and checkpointing flag.
    response_width: R, the responses' padded width (a sliding window must span a whole row).
    """
    config = getattr(base, "config", None)
    if prompt_ids.shape[1] < 2 or getattr(base, "is_gradient_checkpointing", False):
        return None
    if getattr(config, "model_type", None) not in _FAMILIES:
        return None
    if _window_binds(config, prompt_ids.shape[1] + response_width - 1):  # a row's forward is P + R - 1 tokens
        return None
    shared = distinct_prompts(prompt_ids, prompt_mask)
    return shared if len(shared.first) < len(prompt_ids) else None


class PackedLayout(NamedTuple):
    """Where each segment's tokens sit in the packed sequence: N = n_prefix + B * R tokens, the prefixes first
    (prompt u's tokens in order, after prompt u - 1's), then the rows' suffixes (row b's R tokens at
    n_prefix + b * R ...).

    prefix_index: (U, Lp) packed position of prompt u's j-th prefix token (Lp: the longest prefix; 0 where j is
                  past prompt u's prefix)
    prefix_slots: (n_prefix,) the real entries of prefix_index flattened, in packed order
    suffix_shape: (B, R)
    prefix_mask:  (U, 1, Lp, Lp) bool, query j attends key i: i <= j and i real (and i == j, so that no row of
                  a padded position is empty: its output is dropped)
    suffix_mask:  (B, 1, R, Lp + R) bool, over cat(the row's prompt prefix, the row's suffix): the prefix's real
                  tokens, then suffix tokens t' <= t that are real (and t' == t)
    inverse:      (B,) each row's prompt (PromptSharing.inverse)
    """

    prefix_index: torch.Tensor
    prefix_slots: torch.Tensor
    suffix_shape: tuple[int, int]
    prefix_mask: torch.Tensor
    suffix_mask: torch.Tensor
    inverse: torch.Tensor


def packed_layout(shared: PromptSharing, prefix_real: torch.Tensor, suffix_real: torch.Tensor) -> PackedLayout:
    """The layout for U distinct prompts whose prefix tokens are `prefix_real` (U, P - 1) (the prompts' attention
    mask without its last column) and B rows whose suffix tokens are `suffix_real` (B, R) (real = 1)."""
    device = prefix_real.device
    lengths = prefix_real.sum(dim=1)  # (U,)
    longest = int(lengths.max())
    starts = torch.cumsum(lengths, 0) - lengths
    j = torch.arange(longest, device=device)
    real = j[None, :] < lengths[:, None]
    prefix_index = torch.where(real, starts[:, None] + j[None, :], torch.zeros((), dtype=torch.long, device=device))
    rows, width = suffix_real.shape
    eye_p = torch.eye(longest, dtype=torch.bool, device=device)
    prefix_mask = ((j[None, :] <= j[:, None])[None] & real[:, None, :]) | eye_p
    t = torch.arange(width, device=device)
    eye_s = torch.eye(width, dtype=torch.bool, device=device)
    own = ((t[None, :] <= t[:, None])[None] & suffix_real.bool()[:, None, :]) | eye_s
    prompt_keys = real[shared.inverse][:, None, :].expand(rows, width, longest)
    suffix_mask = torch.cat([prompt_keys, own], dim=2)
    slots = torch.nonzero(real.reshape(-1)).squeeze(1)
    return PackedLayout(prefix_index, slots, (rows, width), prefix_mask[:, None], suffix_mask[:, None], shared.inverse)


def packed_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, packed_prompts=None, **_
):
    """Attention over a packed sequence (module docstring), as Transformers calls an attention function.

    query (1, H, N, d), key and value (1, G, N, d) (G divides H: grouped-query heads), after rotary embeddings
    at the rows' own positions. Returns ((1, N, H, d), None). attention_mask is None (the packed call passes
    no mask: the layout, `packed_prompts`, holds it). Gathers are index_select (their backward is an index_add)
    and the suffixes, contiguous in the sequence, are views.
    """
    packed: PackedLayout = packed_prompts
    q, k, v = query[0], key[0], value[0]
    grouped = q.shape[0] != k.shape[0]
    heads, dim = q.shape[0], q.shape[2]
    rows, width = packed.suffix_shape
    n_prefix = len(packed.prefix_slots)

    def suffix(x):  # (heads, N, d) -> (B, heads, R, d)
        return x[:, n_prefix:].unflatten(1, (rows, width)).transpose(0, 1)

    q_s, k_s, v_s = suffix(q), suffix(k), suffix(v)
    parts = []
    prompts, longest = packed.prefix_index.shape
    if longest > 0:

        def prefix(x):  # (heads, N, d) -> (U, heads, Lp, d)
            return x.index_select(1, packed.prefix_index.reshape(-1)).unflatten(1, (prompts, longest)).transpose(0, 1)

        k_p, v_p = prefix(k), prefix(v)
        out_p = F.scaled_dot_product_attention(
            prefix(q), k_p, v_p, attn_mask=packed.prefix_mask, dropout_p=dropout, scale=scaling, enable_gqa=grouped
        )
        parts.append(out_p.transpose(1, 2).reshape(prompts * longest, heads, dim).index_select(0, packed.prefix_slots))
        k_s = torch.cat([k_p.index_select(0, packed.inverse), k_s], dim=2)
        v_s = torch.cat([v_p.index_select(0, packed.inverse), v_s], dim=2)
    # (with every prompt one token long there is no prefix: each suffix attends to its own tokens only, Lp = 0)
    out_s = F.scaled_dot_product_attention(
        q_s, k_s, v_s, attn_mask=packed.suffix_mask, dropout_p=dropout, scale=scaling, enable_gqa=grouped
    )
    parts.append(out_s.transpose(1, 2).reshape(rows * width, heads, dim))
    return torch.cat(parts).unsqueeze(0), None


AttentionInterface.register(_ATTENTION, packed_attention)


@contextlib.contextmanager
def _attention(config, name: str) -> Iterator[None]:
    """The model's attention layers call `name` within the block (they read the config at each forward)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def shared_prompt_logits(
    model,
    config,
    shared: PromptSharing,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_width: int,
    response_width: int,
) -> torch.Tensor:
    """Logits (B, R, V) of the last R columns of the (B, P + R - 1) inputs (forward.build_inputs), the prompt
    part computed once per distinct prompt. `model` is what is called (a DeepSpeed engine, a peft model or the
    causal LM); `config` the causal LM's config (its attention implementation is switched for the call)."""
    cut = prompt_width - 1  # the prefix: every prompt column but the last
    prefix_real = attention_mask[shared.first, :cut].bool()
    layout = packed_layout(shared, prefix_real, attention_mask[:, cut:])
    ids = torch.cat([input_ids[shared.first, :cut][prefix_real], input_ids[:, cut:].reshape(-1)])
    positions = torch.cat([position_ids[shared.first, :cut][prefix_real], position_ids[:, cut:].reshape(-1)])
    with _attention(config, _ATTENTION):
        out = model(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=None,
            use_cache=False,
            logits_to_keep=len(input_ids) * response_width,  # the suffixes: the last B x R tokens
            packed_prompts=layout,
        )
    # a view of the (1, B x R, V) output, not out.logits[0]: indexing would make backward allocate a zero (1, B x R, V)
    # gradient and copy into it (select's backward), 50 MB a micro-batch on the recipe, for nothing
    return out.logits.view(len(input_ids), response_width, -1)
