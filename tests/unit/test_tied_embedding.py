"""tied_input_gradient_as_rows: a tied head's embedding gradient as the batch's rows (added in place, or sparse),
the same dense gradient in the end.

The reference is the same model's dense backward (torch's own embedding backward); equal up to the summation
order of a token's repeated rows: a few float32 ulp of gradients up to ~30 in size (1 ulp at 32 is 4e-6), so
rtol = atol = 1e-5. The batch repeats tokens on purpose (their rows are where the backward passes sum differently)
and holds the padding id 0 (the toy's pad_token_id, the embedding's padding_idx: its row gets no embedding rows).
"""

import pytest
import torch
from transformers import LlamaForCausalLM

from engines.toy.model import ToyShape, build_toy_model
from engines.trainer.tied_embedding import tied_input_gradient_as_rows


def _model(tmp_path, tie: bool):
    folder = build_toy_model(LlamaForCausalLM, tmp_path / f"tie-{tie}", ToyShape(), seed=3, tie_word_embeddings=tie)
    return LlamaForCausalLM.from_pretrained(folder)


BATCHES = (
    torch.tensor([[5, 9, 9, 17, 5, 5, 30], [0, 0, 12, 12, 40, 5, 2]]),  # 5, 9 and 12 repeat; 0 is the padding id
    torch.tensor([[7, 7, 9, 0, 3, 3, 3], [12, 21, 21, 5, 0, 44, 9]]),
)


def _grads(model, batches=1) -> dict[str, torch.Tensor]:
    """The parameters' gradients after `batches` backward passes without zeroing in between (accumulation)."""
    model.zero_grad(set_to_none=True)
    for ids in BATCHES[:batches]:
        weights = torch.linspace(0.5, 2.0, ids.shape[1])
        logits = model(input_ids=ids, use_cache=False).logits
        (logits.log_softmax(-1)[..., 7] * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("batches", [1, 2])
def test_tied_head_gets_the_dense_gradient_from_the_rows(tmp_path, in_place, batches):
    model = _model(tmp_path, tie=True)
    assert model.get_input_embeddings().padding_idx == 0
    dense = _grads(model, batches)
    way = tied_input_gradient_as_rows(model, in_place=in_place)
    assert way == ("in_place" if in_place else "sparse")
    assert model.get_input_embeddings().sparse is not in_place
    rows = _grads(model, batches)
    assert rows.keys() == dense.keys()
    embedding = model.get_input_embeddings().weight
    grad = embedding.grad
    assert grad.layout == torch.strided and grad.shape == embedding.shape  # what the optimizer receives: dense
    for name in dense:
        torch.testing.assert_close(rows[name], dense[name], rtol=1e-5, atol=1e-5, msg=name)
    # the embedding's own rows (tokens in the batch) carry more than the head's gradient: both parts were summed
    head_only = model.lm_head.weight.grad is grad  # tied: one Parameter, one gradient
    assert head_only and float(dense["model.embed_tokens.weight"][9].abs().sum()) > 0


def test_in_place_without_grad_is_a_plain_lookup(tmp_path):
    model = _model(tmp_path, tie=True)
    with torch.no_grad():
        expected = model(input_ids=BATCHES[0], use_cache=False).logits
    tied_input_gradient_as_rows(model, in_place=True)
    with torch.no_grad():
        got = model(input_ids=BATCHES[0], use_cache=False).logits
    assert torch.equal(got, expected) and not got.requires_grad
    assert model.get_input_embeddings().weight.grad is None


@pytest.mark.parametrize("in_place", [True, False])
def test_untied_or_frozen_embeddings_are_left_alone(tmp_path, in_place):
    untied = _model(tmp_path, tie=False)
    assert tied_input_gradient_as_rows(untied, in_place) == ""
    assert not untied.get_input_embeddings().sparse and "forward" not in vars(untied.get_input_embeddings())
    frozen = _model(tmp_path, tie=True)
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert tied_input_gradient_as_rows(frozen, in_place) == ""
    assert not frozen.get_input_embeddings().sparse and "forward" not in vars(frozen.get_input_embeddings())


@pytest.mark.parametrize("thing", [torch.nn.Linear(2, 2), object()])
def test_a_module_without_embeddings_is_left_alone(thing):
    assert tied_input_gradient_as_rows(thing, in_place=True) == ""
