"""model: -- the policy, its dtype and LoRA."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from ppoflow.config.base import _Section


class LoraConfig(_Section):
    rank: int = Field(8, ge=1, description="LoRA rank r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(
        16.0, gt=0, description="LoRA scaling numerator: the adapter's output is scaled by alpha / rank."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input during training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names (last component) of the nn.Linear modules that get an adapter; each must exist in the policy (checked against its config before any work).",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Names (last component) of modules trained in full beside the adapters (peft's modules_to_save), e.g. [lm_head]: a trained copy each, the frozen original stays the reference; each must exist in the policy, not be a target, and not be an embedding tied to the other (checked before any work).",
    )


def default_model_dtype() -> str:
    """model.dtype when unset: "bfloat16" where torch sees a CUDA GPU, else "float32".

    Why bfloat16 weights on a GPU rather than float32 weights under autocast: autocast casts every float32
    weight to bfloat16 at every forward (and the cast's gradient back in the backward); on an H200 those casts
    were a large share of the update's element-wise time (bench.update_mfu). DeepSpeed's bf16 mode keeps the
    float32 master copy in the optimizer instead (engines/trainer/deepspeed_setup.py). Why float32 on a CPU:
    without AVX-512 bfloat16 matmuls are emulated, ~16x slower (engines/precision.py)."""
    import torch  # here, not at the top: the config loads without torch until a default needs a device

    return "bfloat16" if torch.cuda.is_available() else "float32"


# How the config reference (ppoflow/reference.py) shows a default that depends on the machine.
default_model_dtype.reference = "`'float32'` (CPU) / `'bfloat16'` (GPU)"


class ModelConfig(_Section):
    policy_path: str = Field(
        "./runs/_models/tiny-llama",
        description="Local Hugging Face folder of the initial policy (loaded with from_pretrained).",
    )
    critic_path: Optional[str] = Field(
        None, description="Backbone for the critic: a reward-model or causal-LM folder; None = the policy."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default_factory=default_model_dtype,
        description="Weights' precision for actor, critic, reference and rollout. Unset: bfloat16 where torch sees a CUDA GPU (DeepSpeed's bf16 mode: bfloat16 weights and gradients, float32 master weights, gradient accumulation and AdamW state in the optimizer; no casts per forward), float32 elsewhere (these CPUs have no bfloat16 matmul kernels). The value chosen is written to config.yaml, so a resume or a fork keeps it.",
    )
    autocast_dtype: Optional[Literal["bfloat16"]] = Field(
        None,
        description="Mixed precision for the trainer's and the reference's forward/backward and for HF-generate rollouts: matmuls in bfloat16 under torch.autocast while weights, gradients and optimizer state stay in `dtype` (float32). Pays on GPUs and on CPUs with bfloat16 matmul kernels (AVX-512; natively AVX512-BF16 or AMX); on a CPU without them (AVX2 only) bfloat16 is emulated, an update ~16x slower, and preflight refuses the setting. None = off (the default; bfloat16 is never picked for you). (vLLM rollouts follow `dtype`.)",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained."
    )
    apply_chat_template: bool = Field(
        False, description="Wrap prompts with the tokenizer's chat template when it has one."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory in actor and critic.")
    lora: Optional[LoraConfig] = Field(
        None,
        description="LoRA adapters (peft) on the actor: only they train, the frozen base is the reference, checkpoints hold policy/adapter plus the merged policy folder. A critic (algo with a critic) is still fully fine-tuned. Fields: rank (8), alpha (16.0; scale alpha/rank), dropout (0.0), target_modules (q_proj, k_proj, v_proj, o_proj: Linear names the policy must have), modules_to_save ([]: modules trained in full, e.g. [lm_head]); e.g. `--set model.lora.rank=16`. None = full fine-tune.",
    )
