"""Model loading: policy, reference (frozen), critic from policy / reward model / saved critic."""

import json

import pytest
import torch

from engines.models import ValueHeadModel, load_critic, load_policy, load_reference, load_tokenizer, torch_dtype


def test_policy_and_tokenizer_from_folder(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id != tokenizer.eos_token_id
    policy = load_policy(tiny_model_dir)
    assert policy.training and next(policy.parameters()).dtype == torch.float32
    assert policy.config._attn_implementation == "sdpa"
    assert load_policy(tiny_model_dir, "bfloat16", "eager").lm_head.weight.dtype == torch.bfloat16


def test_reference_is_frozen_copy(tiny_model_dir):
    reference = load_reference(tiny_model_dir)
    policy = load_policy(tiny_model_dir)
    assert not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    for (name, a), (_, b) in zip(policy.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"policy folder .*empty.* has no config.json"):
        load_policy(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"dtype 'int8'"):
        torch_dtype("int8")


def test_critic_from_policy_shares_backbone_weights(tiny_model_dir):
    critic = load_critic(tiny_model_dir)
    policy = load_policy(tiny_model_dir)
    # The backbone is the policy's `model` submodule, loaded without the LM head.
    assert torch.equal(critic.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)
    ids = torch.tensor([[1, 10, 11, 12]])
    values = critic(ids, torch.ones_like(ids), torch.arange(4)[None])
    assert values.shape == (1, 4) and values.dtype == torch.float32
    # Small-init head (std 1/(hidden+1), zero bias): values are O(0.1), not O(hidden).
    assert values.abs().max() < 1.0


def test_critic_save_load_round_trip(tiny_model_dir, tmp_path):
    critic = load_critic(tiny_model_dir)
    with torch.no_grad():
        critic.value_head.bias.fill_(0.25)
    critic.save(tmp_path / "critic")
    meta = json.loads((tmp_path / "critic" / "critic.json").read_text())
    assert meta["kind"] == "value_head"
    assert not list((tmp_path / "critic").glob("*.bin")) and not list((tmp_path / "critic").glob("*.pt"))
    again = load_critic(tmp_path / "critic")
    for (name, a), (_, b) in zip(critic.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_critic_from_reward_model_reuses_score_head(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    torch.manual_seed(3)
    reward_model = LlamaForSequenceClassification(config)
    reward_model.save_pretrained(tmp_path / "rm")
    critic = load_critic(tmp_path / "rm")
    assert torch.equal(critic.value_head.weight, reward_model.score.weight)
    assert torch.equal(critic.value_head.bias, torch.zeros(1))  # Llama's score head has no bias
    # Several labels: the head shape does not fit, so a fresh head is made instead.
    config.num_labels = 2
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm2")
    assert isinstance(load_critic(tmp_path / "rm2"), ValueHeadModel)


def _llama(tie: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.mark.parametrize("tie", [False, True])
def test_precast_linear_weights_keeps_autocast_outputs_bit_for_bit(tie):
    import copy

    from engines.models import autocast, precast_linear_weights

    plain = _llama(tie)
    cast = copy.deepcopy(plain)
    # 2 layers x (q, k, v, o, gate, up, down) = 14 Linears, plus the LM head unless it is tied to the
    # embedding (then it must stay float32 with the embedding it shares).
    assert precast_linear_weights(cast, "bfloat16") == 14 + (0 if tie else 1)
    assert cast.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    assert cast.model.embed_tokens.weight.dtype == torch.float32
    assert cast.lm_head.weight.dtype == (torch.float32 if tie else torch.bfloat16)
    assert (cast.lm_head.weight is cast.model.embed_tokens.weight) == tie
    assert torch.equal(
        cast.model.layers[0].self_attn.q_proj.weight, plain.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16)
    )
    ids = torch.randint(3, 64, (3, 9))
    with torch.no_grad(), autocast("bfloat16", "cpu"):
        expected, got = plain(ids).logits, cast(ids).logits
    assert torch.equal(got, expected)
    # Without autocast nothing changes; float32 weights are what autocast=None runs on.
    assert precast_linear_weights(_llama(tie), None) == 0
