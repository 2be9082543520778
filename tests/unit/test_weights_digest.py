"""engines/weights_digest.py: the multiset digest by hand, its layout invariance, and equality across the places a
policy's weights live (a saved folder, a Hugging Face module, the HF sampler under autocast)."""

from __future__ import annotations

import torch

from engines.models import load_policy
from engines.rollout.hf import HFRolloutEngine
from engines.weights_digest import (
    WeightsDigest,
    folder_digest,
    module_digest,
    named_weights_digest,
    policy_record,
    probe_columns,
)
from stages.attest import _expected_digest


def test_the_digest_of_two_values_by_hand():
    # 1.0 = 0x3F800000 = 1065353216 and -2.0 = 0xC0000000 = -1073741824 as int32: sum -8388608; their top 16 bits
    # 0x3F80 = 16256 and 0xC000 = -16384 squared: 264257536 + 268435456 = 532692992. A 1-D tensor is read whole.
    digest = named_weights_digest([("model.norm.weight", torch.tensor([1.0, -2.0]))], tied_head=False)
    assert digest == WeightsDigest(value=f"{-8388608 % 2**64:016x}{532692992:016x}", dtypes=("float32",))


def test_a_fused_layer_and_zero_padding_read_as_their_parts():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, 32, generator=generator) for rows in (32, 8, 8))
    embedding = torch.randn(10, 32, generator=generator)
    apart = named_weights_digest(
        [("q_proj.weight", q), ("k_proj.weight", k), ("v_proj.weight", v), ("embed_tokens.weight", embedding)], False
    )
    padded = torch.cat([embedding, torch.zeros(6, 32)])  # vLLM pads the vocabulary with zero rows
    fused = named_weights_digest([("qkv_proj.weight", torch.cat([q, k, v])), ("embed_tokens.weight", padded)], False)
    assert fused == apart


def test_a_changed_value_in_a_read_column_changes_the_digest_and_an_unread_one_does_not():
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    read, unread = probe_columns(64)[1], 1  # columns 0, 4, 8, ... are read (64 / 16 apart)
    assert unread not in probe_columns(64)
    before = named_weights_digest([("o_proj.weight", weight)], False)
    for column, changes in ((read, True), (unread, False)):
        moved = weight.clone()
        moved[2, column] = torch.nextafter(moved[2, column], torch.tensor(10.0))  # one ulp
        assert (named_weights_digest([("o_proj.weight", moved)], False) != before) is changes


def test_a_module_its_folder_and_a_bfloat16_copy(tiny_model_dir):
    model = load_policy(str(tiny_model_dir), "float32", "sdpa")
    assert module_digest(model) == folder_digest(tiny_model_dir)
    in_bf16 = module_digest(model.to(torch.bfloat16))
    assert in_bf16.dtypes == ("bfloat16",) and in_bf16.value != folder_digest(tiny_model_dir).value
    assert in_bf16.value == folder_digest(tiny_model_dir, "bfloat16").value  # rounding is all that differs


def test_the_hf_sampler_under_autocast_holds_the_records_rounded_digest(tiny_model_dir):
    engine = HFRolloutEngine(str(tiny_model_dir), autocast_dtype="bfloat16")  # Linear weights kept in bfloat16
    record = policy_record(tiny_model_dir, "bfloat16")
    found = engine.weights_digest()
    assert found.dtypes == ("bfloat16", "float32")
    assert found == _expected_digest(record, engine.digest_precision)
    assert found.value != record["value"]


def test_a_state_dict_handed_over_in_memory_records_what_its_folder_records(tiny_model_dir, tmp_path):
    """state_dict_record (the in-memory loop's record) equals policy_record of the same weights saved, for an untied
    head and a tied one (whose state dict names the head's tensor a second time)."""
    from transformers import LlamaForCausalLM

    from engines.toy.model import ToyShape, build_toy_model
    from engines.weights_digest import state_dict_record

    tied_dir = build_toy_model(LlamaForCausalLM, tmp_path / "tied", ToyShape(), 0, tie_word_embeddings=True)
    for folder in (tiny_model_dir, tied_dir):
        state_dict = load_policy(str(folder), "float32", "sdpa").state_dict()
        assert state_dict_record(state_dict, "bfloat16") == policy_record(folder, "bfloat16")
