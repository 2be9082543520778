"""save_pretrained_hashed: Hugging Face's own folder layout, written by ppoflow's safetensors writer, with
each weight file's sha256 (checked here against hashlib over the bytes read back)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import transformers.modeling_utils as hf_modeling
from safetensors import safe_open
from safetensors.torch import save_file as SAFETENSORS_SAVE_FILE

from engines import hf_save
from engines.hf_save import save_pretrained_hashed
from engines.models import load_policy


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=tie,
        )
    )


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("tie", [False, True])
def test_folder_loads_back_and_digests_are_the_files(tmp_path, tie):
    model = _llama(tie)
    digests = save_pretrained_hashed(model, tmp_path / "m")
    files = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert files == ["model.safetensors"] and sorted(digests) == files
    assert digests["model.safetensors"] == _sha256(tmp_path / "m" / "model.safetensors")
    assert (tmp_path / "m" / "config.json").is_file()
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        # a tied LM head is not stored twice (Hugging Face removes it before writing)
        assert ("lm_head.weight" in f.keys()) != tie
    again = load_policy(tmp_path / "m")
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert hf_modeling.safe_save_file is SAFETENSORS_SAVE_FILE


def test_sharded_folder_hashes_every_shard(tmp_path):
    model = _llama(False)
    digests = save_pretrained_hashed(model, tmp_path / "m", max_shard_size="200KB")
    shards = sorted((tmp_path / "m").glob("*.safetensors"))
    assert len(shards) > 2 and sorted(digests) == [p.name for p in shards]
    assert all(digests[p.name] == _sha256(p) for p in shards)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(digests)
    again = load_policy(tmp_path / "m")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_failed_write_restores_the_original_writer(tmp_path, monkeypatch):
    def refuse(tensors, path, metadata=None):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(hf_save, "write_safetensors", refuse)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained_hashed(_llama(False), tmp_path / "m")
    assert hf_modeling.safe_save_file is SAFETENSORS_SAVE_FILE
