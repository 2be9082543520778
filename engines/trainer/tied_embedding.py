"""The input embedding's gradient as the batch's rows when the policy's head shares its weight (tied embeddings).

    tied_input_gradient_as_rows(model, in_place) -> str   "in_place", "sparse" or "" (left as it was)

Why: a tied weight (SmolLM2, Qwen2.5-0.5B: `tie_word_embeddings`) gets two gradients in every backward: the head's,
dense (V, H), and the input embedding's, which touches only the rows of the tokens in the micro-batch. torch's dense
embedding backward builds that second gradient as a zeroed (V, H) tensor with those rows added in, then autograd adds
the two (V, H) tensors: on the recipe (V = 49152, H = 576) a 113 MB fill and a 113 MB add per micro-batch.

Two ways out, the same gradient up to the order in which a token that occurs several times has its rows summed
(rounding: ~1e-6 on the recipe; runs are not bit-identical to runs before, a run is to itself and its resumption):
  "sparse"    the embedding returns its gradient as sparse rows (nn.Embedding(sparse=True)), which autograd adds to
              the head's dense gradient. No fill, but autograd's sum of a dense and a sparse gradient is still out of
              place: a new (V, H) tensor, copied, per micro-batch (torch.profiler: aten::copy_ on [49152, 576],
              ~250 ms of each backward on the 2-core CPU, mostly the new tensor's page faults).
  "in_place"  the lookup reads the weight without an autograd edge to it, and a hook on its output adds the rows
              into weight.grad with index_add_ once they are known. The head's gradient has reached weight.grad by
              then: the embedding is the first operation of the forward, so its gradient is the last the backward
              computes, and the weight's accumulation runs as soon as the head's gradient exists (autograd runs
              gradient accumulation before any other ready node). Only where weight.grad stays where backward
              leaves it until the optimizer step: DeepSpeed's ZeRO stage 0 (the float32 default). Stages 1-3
              move or partition gradients from hooks on the accumulation, which would have run before the rows
              came; there "sparse" applies.

Only where the head is the same Parameter as the input embedding and is trained: the weight's gradient is the dense
head gradient plus the rows, so the optimizer still sees a dense gradient. An untied embedding keeps its dense
gradient, as does a frozen one (LoRA: no gradient at all). The padding row (nn.Embedding's padding_idx) gets no
rows, as torch's embedding backward gives it none.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def tied_input_gradient_as_rows(model: torch.nn.Module, in_place: bool) -> str:
    """Make `model`'s input embedding hand its gradient over as the batch's rows when its weight is the output head's,
    trained: added into weight.grad in place (`in_place`, for ZeRO stage 0: module docstring) or as sparse rows.

    `model`: a Transformers causal LM (or a wrapper with get_input_embeddings / get_output_embeddings). Returns the
    way switched on, or "" when anything else (no head, untied, frozen, not an nn.Embedding) left it as it was.
    """
    try:
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return ""
    if not isinstance(embedding, torch.nn.Embedding) or head is None:
        return ""
    weight = embedding.weight
    if getattr(head, "weight", None) is not weight or not weight.requires_grad:
        return ""
    if not in_place:
        embedding.sparse = True
        return "sparse"
    embedding.forward = types.MethodType(_lookup_rows_into_gradient, embedding)
    return "in_place"


def _lookup_rows_into_gradient(embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """nn.Embedding.forward without the weight's autograd edge; its gradient rows go into weight.grad (add_rows).
    Shapes: ids (...,) -> (..., H)."""
    weight = embedding.weight
    out = F.embedding(ids, weight.detach(), embedding.padding_idx)
    if torch.is_grad_enabled():
        out.requires_grad_()  # a leaf of the graph: its gradient is the rows, and its hook hands them on
        out.register_hook(lambda rows: _add_rows(weight, ids, rows, embedding.padding_idx))
    return out


@torch.no_grad()
def _add_rows(weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, padding_idx) -> None:
    """weight.grad[ids[i]] += rows[i] for every position i but the padding row's; weight.grad is created (zeros) when
    nothing else gave the weight a gradient in this backward. rows: (..., H) matching ids (...,)."""
    index, rows = ids.reshape(-1), rows.reshape(-1, rows.shape[-1])
    if padding_idx is not None:
        keep = index != padding_idx
        index, rows = index[keep], rows[keep]
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, index, rows.to(weight.grad.dtype))
