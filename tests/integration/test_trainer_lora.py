"""LoRA (peft) through the trainer on real DeepSpeed (CPU, one rank): the adapter checkpoint, the merged policy
folder, the frozen base as the reference, resume, and target checks before any work."""

from __future__ import annotations

import pytest
import torch

from engines.scoring.reference import ReferenceModel
from engines.trainer.lora import check_targets, shared_reference
from engines.trainer.ppo_trainer import PPOTrainer
from tests.integration.test_trainer import _batch, _cfg

pytestmark = pytest.mark.slow

LORA = {
    "algo.name": "grpo",
    "model.lora.rank": 4,
    "model.lora.alpha": 8,
    "train.actor_lr": 1e-2,
    "model.lora.target_modules": "[q_proj, v_proj, down_proj]",
}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """A LoRA trainer after one update, saved; then a second update (the uninterrupted run)."""
    batches = _batch(tiny_model_dir, 1), _batch(tiny_model_dir, 2)
    out = tmp_path_factory.mktemp("lora_ckpt")
    cfg = _cfg(tiny_model_dir, **LORA)
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    trainer.update(batches[0])
    trainer.save(str(out))
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 40, 63]])
    trainer.actor.module.eval()
    saved_logits = _logits(trainer.actor.module, ids)
    trainer.actor.module.train()
    return dict(cfg=cfg, trainer=trainer, out=out, ids=ids, saved_logits=saved_logits, batches=batches)


def test_only_the_adapters_train_and_the_base_stays_the_initial_policy(lora_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    module = lora_run["trainer"].actor.module
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    # 2 layers x 3 targets x (A, B)
    assert len(trainable) == 12 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    frozen = {
        n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
        for n, p in module.named_parameters()
        if not p.requires_grad
    }
    assert set(frozen) == set(base)
    for name, p in frozen.items():
        assert torch.equal(p, base[name]), name
    # B moved off its initial 0
    assert any(float(p.detach().abs().max()) > 0 for n, p in module.named_parameters() if ".lora_B." in n)


def test_adapter_and_merged_folders_load_and_give_the_trainers_logits(lora_run, tiny_model_dir):
    """adapter: peft on the base model; merged: plain transformers (what vLLM loads). Both must compute the
    trainer's function. Tolerance: W x + s B (A x) vs (W + s B A) x differ by fp32 reassociation only (~1e-6
    on logits of size ~1); peft's own merge_and_unload is the second implementation of the merged weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = lora_run["out"] / "policy"
    assert (policy / "adapter" / "adapter_model.safetensors").is_file()
    assert (policy / "adapter" / "adapter_config.json").is_file()
    ids, expected = lora_run["ids"], lora_run["saved_logits"]
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), policy / "adapter")
    with_adapter.eval()
    torch.testing.assert_close(_logits(with_adapter, ids), expected, atol=1e-6, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(policy)
    torch.testing.assert_close(_logits(merged, ids), expected, atol=1e-5, rtol=0)
    peft_merged = with_adapter.merge_and_unload().state_dict()
    for name, value in merged.state_dict().items():
        torch.testing.assert_close(value, peft_merged[name], atol=1e-6, rtol=0, msg=name)
    assert not torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ids), expected, atol=1e-3)


def test_shared_base_reference_scores_the_initial_policy_without_a_copy(lora_run, tiny_model_dir):
    trainer, batch = lora_run["trainer"], lora_run["batches"][0]
    prompts = [row[row_mask.bool()].tolist() for row, row_mask in zip(batch.prompt_ids, batch.prompt_mask)]
    responses = [row[: int(m.sum())].tolist() for row, m in zip(batch.response_ids, batch.response_mask)]
    shared = shared_reference(trainer)
    assert shared.model is trainer.actor.module  # the trainer's own weights, not a loaded copy
    loaded = ReferenceModel(str(tiny_model_dir), micro_batch_size=8)
    assert shared.fingerprint == loaded.fingerprint
    for a, b in zip(shared.logprobs(prompts, responses), loaded.logprobs(prompts, responses)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    # The adapters are back on and the module trains again afterwards.
    assert trainer.actor.module.training
    trainer.actor.module.eval()
    torch.testing.assert_close(_logits(trainer.actor.module, lora_run["ids"]), lora_run["saved_logits"])
    trainer.actor.module.train()


def test_resume_from_the_adapter_equals_uninterrupted(lora_run, tiny_model_dir):
    trainer, out, second = lora_run["trainer"], lora_run["out"], lora_run["batches"][1]
    resumed = PPOTrainer(lora_run["cfg"], str(out / "policy"), trainer_state_dir=str(out / "trainer"))
    trainer.update(second)
    resumed.update(second)
    live = dict(trainer.actor.module.named_parameters())
    for name, p in resumed.actor.module.named_parameters():
        assert torch.equal(p, live[name]), name


def test_a_target_module_the_model_lacks_is_named_before_any_work(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, **dict(LORA, **{"model.lora.target_modules": "[q_proj, qkv_proj]"}))
    with pytest.raises(ValueError) as err:
        check_targets(tiny_model_dir, cfg.model.lora)
    message = str(err.value)
    assert "model.lora.target_modules" in message and "['qkv_proj']" in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        assert name in message
    with pytest.raises(ValueError, match="qkv_proj"):
        PPOTrainer(cfg, str(tiny_model_dir))


def test_lora_with_gradient_checkpointing_gives_the_adapters_the_same_gradients(tiny_model_dir):
    """With a frozen base nothing entering a checkpointed layer needs a gradient unless the embeddings' output
    is made to (reentrant checkpointing would then give the adapters none; transformers' own switch covers
    it today, this test keeps it covered). At the first
    step B = 0, so only the B matrices get a gradient (dL/dA = B^T ... = 0): those must equal the plain run's
    up to fp32 rounding (1e-5 of each tensor's largest entry, as in test_trainer_scale)."""
    from tests.integration.test_trainer_scale import _grads_at_first_step

    batch = _batch(tiny_model_dir, 1)
    runs = []
    for checkpointing in (False, True):
        cfg = _cfg(
            tiny_model_dir,
            **dict(
                LORA, **{"model.gradient_checkpointing": checkpointing, "train.zero_stage": 0, "train.ppo_epochs": 1}
            ),
        )
        trainer = PPOTrainer(cfg, str(tiny_model_dir))
        grads = _grads_at_first_step(trainer)
        trainer.update(batch)
        runs.append(grads)
    plain, ckpt = runs
    lora_b = [n for n in plain if ".lora_B." in n]
    assert set(plain) == set(ckpt) and len(lora_b) == 6
    for name in lora_b:
        scale = float(plain[name].abs().max())
        assert scale > 0, name
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-5 * scale, rtol=0, msg=name)


# --- model.lora.modules_to_save: a fully trained copy of lm_head beside the adapters -------------------------

SAVE_HEAD = dict(LORA, **{"model.lora.target_modules": "[q_proj, v_proj]", "model.lora.modules_to_save": "[lm_head]"})


def test_a_module_to_save_trains_in_full_lands_in_both_folders_and_stays_the_original_in_the_reference(
    tiny_model_dir, tmp_path
):
    """After one update: the trainable parameters are the adapters plus one lm_head copy; the merged folder
    (transformers) and the adapter folder (peft on the base) both compute the trainer's logits, the merged
    lm_head is the trained copy (not the base's), peft's merge_and_unload agrees tensor by tensor; the shared-base
    reference still scores the initial policy; a resume from the folders trains on exactly as the live trainer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batches = _batch(tiny_model_dir, 1), _batch(tiny_model_dir, 2)
    cfg = _cfg(tiny_model_dir, **SAVE_HEAD)
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    module = trainer.actor.module
    trainable = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    # 2 layers x 2 targets x (A, B), and the copy of lm_head
    assert len(trainable) == 9 and trainable[0] == "base_model.model.lm_head.modules_to_save.default.weight"
    trainer.update(batches[0])
    trainer.save(str(tmp_path))

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained_head = dict(module.named_parameters())["base_model.model.lm_head.modules_to_save.default.weight"]
    assert not torch.allclose(trained_head, base.lm_head.weight, atol=1e-4)  # it moved
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 40, 63]])
    module.eval()
    expected = _logits(module, ids)
    module.train()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert torch.equal(merged.lm_head.weight, trained_head.detach())
    torch.testing.assert_close(_logits(merged, ids), expected, atol=1e-5, rtol=0)
    with_adapter = PeftModel.from_pretrained(base, tmp_path / "policy" / "adapter")
    with_adapter.eval()
    torch.testing.assert_close(_logits(with_adapter, ids), expected, atol=1e-6, rtol=0)
    peft_merged = with_adapter.merge_and_unload().state_dict()
    for name, value in merged.state_dict().items():
        torch.testing.assert_close(value, peft_merged[name], atol=1e-6, rtol=0, msg=name)

    batch = batches[0]
    prompts = [row[row_mask.bool()].tolist() for row, row_mask in zip(batch.prompt_ids, batch.prompt_mask)]
    responses = [row[: int(m.sum())].tolist() for row, m in zip(batch.response_ids, batch.response_mask)]
    loaded = ReferenceModel(str(tiny_model_dir), micro_batch_size=8)
    for a, b in zip(shared_reference(trainer).logprobs(prompts, responses), loaded.logprobs(prompts, responses)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)

    resumed = PPOTrainer(cfg, str(tmp_path / "policy"), trainer_state_dir=str(tmp_path / "trainer"))
    trainer.update(batches[1])
    resumed.update(batches[1])
    live = dict(trainer.actor.module.named_parameters())
    for name, p in resumed.actor.module.named_parameters():
        assert torch.equal(p, live[name]), name


def test_modules_to_save_that_cannot_be_trained_are_named_before_any_work(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    def problem(model_dir, **lora) -> str:
        cfg = _cfg(tiny_model_dir, **dict(LORA, **lora))
        with pytest.raises(ValueError) as err:
            check_targets(model_dir, cfg.model.lora)
        return str(err.value)

    message = problem(tiny_model_dir, **{"model.lora.modules_to_save": "[lm_head, score]"})
    assert "model.lora.modules_to_save" in message and "['score']" in message and "embed_tokens" in message
    message = problem(tiny_model_dir, **{"model.lora.modules_to_save": "[v_proj]"})
    assert "['v_proj'] both in target_modules" in message
    # the same model with tied embeddings (only config.json is read: the check loads no weights)
    tied = AutoConfig.from_pretrained(tiny_model_dir)
    tied.tie_word_embeddings = True
    tied.save_pretrained(tmp_path)
    for name in ("lm_head", "embed_tokens"):
        message = problem(tmp_path, **{"model.lora.modules_to_save": f"[{name}]"})
        assert f"['{name}'] is tied to the other embedding" in message
    check_targets(tiny_model_dir, _cfg(tiny_model_dir, **SAVE_HEAD).model.lora)  # untied: accepted
