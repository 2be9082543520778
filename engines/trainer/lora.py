"""LoRA on the actor (peft): wrapping, target checks, the merged policy folder and the adapter folder.

With `model.lora` set, the actor is `peft.get_peft_model(policy, LoraConfig(...))`: every nn.Linear whose
last name component is in `target_modules` gets A (rank x in) and B (out x rank, zero-initialised, so the
wrapped model starts equal to the base) and computes W x + (alpha / rank) * B A dropout(x). Only A and B
train; the base weights stay frozen, so the frozen base IS the reference policy (peft's `disable_adapter()`
scores with it, see engines/scoring/reference.py `ReferenceModel.shared_base`).

A checkpoint's policy folder holds both:
    policy/            the merged weights (W + (alpha / rank) B A) under the base model's own names, as
                       save_pretrained writes them: what transformers and vLLM load (the rollout engine reads
                       this, the full model's size, every iteration)
    policy/adapter/    adapter_model.safetensors + adapter_config.json (peft's format: A and B only), what
                       `PeftModel.from_pretrained(base, policy/adapter)` loads and what a resumed trainer loads
                       on top of `model.policy_path`
The merge here is computed from the state dict (so a ZeRO-3 gathered state dict works too) and is written
independently of peft's own `merge_and_unload` (the tests compare the two).

Failure modes: a target name the model lacks raises ValueError naming model.lora.target_modules and listing
the model's Linear names (`check_targets`, read from config.json on the meta device: no weights loaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

ADAPTER_DIR = "adapter"
_ADAPTER = "default"  # peft's name for the one adapter


def linear_names(policy_path: str | Path) -> list[str]:
    """Sorted last name components of the nn.Linear modules of the causal LM in `policy_path` (built from its
    config.json on the meta device: no weights are read, no memory is spent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(policy_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def check_targets(policy_path: str | Path, lora_cfg) -> None:
    """ValueError naming model.lora.target_modules when one of them is not a Linear of the policy."""
    available = linear_names(policy_path)
    missing = [t for t in lora_cfg.target_modules if t not in available]
    if missing:
        raise ValueError(
            f"model.lora.target_modules={lora_cfg.target_modules}: {missing} not in the policy "
            f"{str(policy_path)!r}; its Linear modules are {available}"
        )


def peft_config(lora_cfg):
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
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
    """The trainer's policy, with gradient checkpointing and (model.lora) LoRA adapters as configured.

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
    return wrap_policy(policy, lora_cfg, adapter) if lora_cfg is not None else policy


def adapter_dir_of(policy_dir: str | Path) -> Optional[Path]:
    """policy_dir/adapter when a LoRA checkpoint wrote one, else None."""
    folder = Path(policy_dir) / ADAPTER_DIR
    return folder if (folder / "adapter_config.json").is_file() else None


def merged_state_dict(peft_state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PeftModel's full state dict -> the base model's state dict with every adapter merged in.

    Keys: "base_model.model.<name>.base_layer.weight" -> "<name>.weight" holding W + scaling * (B @ A),
    "<...>.lora_A.default.weight" (rank, in) and "lora_B" (out, rank) are consumed, every other key loses
    the "base_model.model." prefix. scaling = alpha / rank. Tensors come out new (merged) or as given.
    """
    prefix = "base_model.model."
    merged: dict[str, torch.Tensor] = {}
    for key, value in peft_state.items():
        name = key.removeprefix(prefix)
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
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
    from peft import get_peft_model_state_dict

    from engines.hf_save import save_pretrained_hashed

    out = Path(policy_dir)
    merged = merged_state_dict(full_state, lora_cfg.alpha / lora_cfg.rank)
    digests = save_pretrained_hashed(peft_model.get_base_model(), out, state_dict=merged)
    adapter = get_peft_model_state_dict(peft_model, state_dict=full_state)
    peft_model.save_pretrained(str(out / ADAPTER_DIR), state_dict=adapter, safe_serialization=True)
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
