"""LoRA on the actor (peft): wrapping, target checks, the merged policy folder and the adapter folder.

With `model.lora` set, the actor is `peft.get_peft_model(policy, LoraConfig(...))`: every nn.Linear whose
last name component is in `target_modules` gets A (rank x in) and B (out x rank, zero-initialised, so the
wrapped model starts equal to the base) and computes W x + (alpha / rank) * B A dropout(x); a module named in
`modules_to_save` (e.g. lm_head, a norm) gets a fully trained copy beside its frozen original. Only A, B and
those copies train; the base weights stay frozen, so the frozen base IS the reference policy (peft's
`disable_adapter()` scores with it, originals included, see engines/scoring/reference.py
`ReferenceModel.shared_base`).

A checkpoint's policy folder holds both:
    policy/            the merged weights (W + (alpha / rank) B A) under the base model's own names, as
                       save_pretrained writes them: what transformers and vLLM load (the rollout engine reads
                       this, the full model's size, every iteration)
    policy/adapter/    adapter_model.safetensors + adapter_config.json (peft's format: A, B and the trained
                       copies of modules_to_save), what
                       `PeftModel.from_pretrained(base, policy/adapter)` loads and what a resumed trainer loads
                       on top of `model.policy_path`
The merge here is computed from the state dict (so a ZeRO-3 gathered state dict works too) and is written
independently of peft's own `merge_and_unload` (the tests compare the two).

Failure modes: a target name the model lacks raises ValueError naming model.lora.target_modules and listing
the model's Linear names; a modules_to_save name it lacks, one in both lists, or a tied embedding, a ValueError
naming model.lora.modules_to_save (`check_targets`, read from config.json on the meta device: no weights loaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from engines.trainer.tied_embedding import tied_input_gradient_as_rows

ADAPTER_DIR = "adapter"
_ADAPTER = "default"  # peft's name for the one adapter


def _meta_model(policy_path: str | Path) -> nn.Module:
    """The causal LM of `policy_path` built from its config.json on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(policy_path))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_targets(policy_path: str | Path, lora_cfg) -> None:
    """ValueError naming the field when a model.lora.target_modules entry is not a Linear of the policy, a
    model.lora.modules_to_save entry is no module of it, a name is in both lists, or modules_to_save names an
    embedding tied to the other one (the merged folder could not hold a trained lm_head apart from the input
    embeddings: transformers ties them again on load)."""
    model = _meta_model(policy_path)
    modules = {name.rsplit(".", 1)[-1]: m for name, m in model.named_modules() if name}
    available = sorted(n for n, m in modules.items() if isinstance(m, nn.Linear))
    missing = [t for t in lora_cfg.target_modules if t not in available]
    if missing:
        raise ValueError(
            f"model.lora.target_modules={lora_cfg.target_modules}: {missing} not in the policy "
            f"{str(policy_path)!r}; its Linear modules are {available}"
        )
    saved = list(lora_cfg.modules_to_save)
    if unknown := [n for n in saved if n not in modules]:
        raise ValueError(
            f"model.lora.modules_to_save={saved}: {unknown} not in the policy {str(policy_path)!r}; its modules "
            f"are {sorted(modules)}"
        )
    if both := sorted(set(saved) & set(lora_cfg.target_modules)):
        raise ValueError(
            f"model.lora: {both} both in target_modules (an adapter) and modules_to_save (a fully trained copy); "
            "name each module in one of them"
        )
    embedding_modules = (model.get_input_embeddings(), model.get_output_embeddings())
    embeddings = {n for n, m in modules.items() if any(m is e for e in embedding_modules)}
    if model.config.get_text_config().tie_word_embeddings and (tied := sorted(embeddings & set(saved))):
        raise ValueError(
            f"model.lora.modules_to_save={saved}: {tied} is tied to the other embedding of the policy "
            f"{str(policy_path)!r} (tie_word_embeddings), so a trained copy of it could not be saved apart; "
            "train it with an adapter (target_modules, for lm_head) or without LoRA"
        )


def peft_config(lora_cfg):
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        modules_to_save=list(lora_cfg.modules_to_save) or None,
        task_type=TaskType.CAUSAL_LM,
        bias="none",
    )


def wrap_policy(policy: nn.Module, lora_cfg, adapter_dir: Optional[str | Path] = None) -> nn.Module:
    """The policy with trainable LoRA adapters: new ones (B = 0), or the saved ones of `adapter_dir`."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        return PeftModel.from_pretrained(policy, str(adapter_dir), is_trainable=True)
    return get_peft_model(policy, peft_config(lora_cfg))


def load_actor(cfg, policy_dir: str | Path) -> nn.Module:
    """The trainer's policy, with gradient checkpointing and (model.lora) LoRA adapters as configured; without
    LoRA, a tied head's input-embedding gradient comes as the batch's rows (tied_embedding.py).

    LoRA: a checkpoint's policy folder holds merged weights plus policy/adapter; the trainer rebuilds from the
    frozen base (model.policy_path) and the saved adapter, so base and reference stay the initial policy.
    ValueError names model.lora.target_modules the model lacks (checked before any weights are read).
    """
    from engines.models import load_policy

    lora_cfg = cfg.model.lora
    adapter = adapter_dir_of(policy_dir) if lora_cfg is not None else None
    base_dir = cfg.model.policy_path if adapter is not None else policy_dir
    if lora_cfg is not None:
        check_targets(base_dir, lora_cfg)
    policy = load_policy(base_dir, cfg.model.dtype, cfg.model.attn_implementation)
    if cfg.model.gradient_checkpointing:
        # transformers 5.19: non-reentrant checkpointing, and it makes the (frozen) embeddings' output require
        # grad itself, so adapters inside checkpointed layers get their gradients (tested)
        policy.gradient_checkpointing_enable()
    if lora_cfg is not None:
        return wrap_policy(policy, lora_cfg, adapter)
    # not a zeroed (V, H) tensor per micro-batch; added into the gradient in place where ZeRO leaves it there
    tied_input_gradient_as_rows(policy, in_place=cfg.train.zero_stage == 0)  # PPOFlowConfig resolved the stage
    return policy


def adapter_dir_of(policy_dir: str | Path) -> Optional[Path]:
    """policy_dir/adapter when a LoRA checkpoint wrote one, else None."""
    folder = Path(policy_dir) / ADAPTER_DIR
    return folder if (folder / "adapter_config.json").is_file() else None


def merged_state_dict(peft_state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PeftModel's full state dict -> the base model's state dict with every adapter merged in.

    Keys: "base_model.model.<name>.base_layer.weight" -> "<name>.weight" holding W + scaling * (B @ A),
    "<...>.lora_A.default.weight" (rank, in) and "lora_B" (out, rank) are consumed; a module of
    modules_to_save: "<name>.modules_to_save.default.<leaf>" (the trained copy) -> "<name>.<leaf>", and its
    frozen "<name>.original_module.<leaf>" is dropped; every other key loses the "base_model.model." prefix.
    scaling = alpha / rank. Tensors come out new (merged) or as given.
    """
    prefix = "base_model.model."
    copy = f".modules_to_save.{_ADAPTER}."
    merged: dict[str, torch.Tensor] = {}
    for key, value in peft_state.items():
        name = key.removeprefix(prefix)
        if ".lora_" in name or ".original_module." in name:
            continue
        if copy in name:
            module, _, leaf = name.partition(copy)
            name = f"{module}.{leaf}"
        elif ".base_layer." in name:
            module, _, leaf = name.rpartition(".base_layer.")
            if leaf == "weight":
                a = peft_state[f"{prefix}{module}.lora_A.{_ADAPTER}.weight"]
                b = peft_state[f"{prefix}{module}.lora_B.{_ADAPTER}.weight"]
                value = value + scaling * (b.float() @ a.float()).to(value.dtype)
            name = f"{module}.{leaf}"
        merged[name] = value.detach()
    return merged


def save_lora_policy(
    peft_model, full_state: dict[str, torch.Tensor], policy_dir: str | Path, lora_cfg
) -> dict[str, str]:
    """Write the merged HF folder to policy_dir and the adapter to policy_dir/adapter (module docstring).

    full_state: the PeftModel's full state dict (live or ZeRO-3 gathered). Returns {relative name: sha256} of
    the merged weight files (the adapter's few KB are hashed by the checkpoint when it stages them).
    """
    from engines.hf_save import save_pretrained_hashed

    out = Path(policy_dir)
    merged = merged_state_dict(full_state, lora_cfg.alpha / lora_cfg.rank)
    digests = save_pretrained_hashed(peft_model.get_base_model(), out, state_dict=merged)
    # the full state dict: save_pretrained picks the adapter's tensors out of it itself (handing it the adapter's
    # own state dict, picked already, fails on a modules_to_save copy, whose key peft has renamed by then)
    peft_model.save_pretrained(str(out / ADAPTER_DIR), state_dict=full_state, safe_serialization=True)
    return digests


def shared_reference(trainer):
    """With model.lora: a ReferenceModel scoring with the trainer's frozen actor base (no second copy of the
    weights, engines/scoring/reference.py `ReferenceModel.shared_base`); None without LoRA (the base moves)."""
    cfg = trainer.cfg
    if cfg.model.lora is None:
        return None
    from engines.scoring.reference import ReferenceModel

    return ReferenceModel.shared_base(
        trainer.actor.module,
        cfg.model.policy_path,
        cfg.model.dtype,
        cfg.rollout.temperature,
        cfg.train.micro_batch_size,
        cfg.train.logprob_chunk,
        cfg.model.autocast_dtype,
    )
