"""sparse_tied_input_gradient: a tied head's embedding gradient as sparse rows, the same dense gradient in the end.

The reference is the same model's dense backward (torch's own embedding backward); equal up to the summation
order of a token's repeated rows: a few float32 ulp of gradients up to ~30 in size (1 ulp at 32 is 4e-6), so
rtol = atol = 1e-5. The batch repeats tokens on purpose: their rows are where the two backward passes sum
differently.
"""

import pytest
import torch
from transformers import LlamaForCausalLM

from engines.toy.model import ToyShape, build_toy_model
from engines.trainer.tied_embedding import sparse_tied_input_gradient


def _model(tmp_path, tie: bool):
    folder = build_toy_model(LlamaForCausalLM, tmp_path / f"tie-{tie}", ToyShape(), seed=3, tie_word_embeddings=tie)
    return LlamaForCausalLM.from_pretrained(folder)


def _grads(model) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ids = torch.tensor([[5, 9, 9, 17, 5, 5, 30], [9, 12, 12, 12, 40, 5, 2]])  # 5, 9 and 12 repeat
    weights = torch.linspace(0.5, 2.0, ids.shape[1])
    logits = model(input_ids=ids, use_cache=False).logits
    (logits.log_softmax(-1)[..., 7] * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_tied_head_gets_the_dense_gradient_from_sparse_rows(tmp_path):
    model = _model(tmp_path, tie=True)
    dense = _grads(model)
    assert sparse_tied_input_gradient(model) is True
    assert model.get_input_embeddings().sparse
    sparse = _grads(model)
    assert sparse.keys() == dense.keys()
    embedding = model.get_input_embeddings().weight
    grad = embedding.grad
    assert grad.layout == torch.strided and grad.shape == embedding.shape  # what the optimizer receives: dense
    for name in dense:
        torch.testing.assert_close(sparse[name], dense[name], rtol=1e-5, atol=1e-5, msg=name)
    # the embedding's own rows (tokens in the batch) carry more than the head's gradient: both parts were summed
    head_only = model.lm_head.weight.grad is grad  # tied: one Parameter, one gradient
    assert head_only and float(dense["model.embed_tokens.weight"][9].abs().sum()) > 0


def test_untied_or_frozen_embeddings_are_left_alone(tmp_path):
    untied = _model(tmp_path, tie=False)
    assert sparse_tied_input_gradient(untied) is False
    assert not untied.get_input_embeddings().sparse
    frozen = _model(tmp_path, tie=True)
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert sparse_tied_input_gradient(frozen) is False
    assert not frozen.get_input_embeddings().sparse


@pytest.mark.parametrize("thing", [torch.nn.Linear(2, 2), object()])
def test_a_module_without_embeddings_is_left_alone(thing):
    assert sparse_tied_input_gradient(thing) is False
