"""train: -- the update: batches, optimizer, DeepSpeed, ranks."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from ppoflow.config.base import _REMOVED_RANK_FIELDS, _Section


class TrainConfig(_Section):
    zero_stage: Optional[int] = Field(
        None,
        ge=0,
        le=3,
        description=(
            "DeepSpeed ZeRO stage. None = chosen from the weights' dtype and train.offload (`default_zero_stage`): "
            "0 for float32 weights without offload, where ZeRO's fp32 master partition only duplicates the "
            "weights and copying every micro-batch's gradients into it cost a quarter of the update on "
            "SmolLM2-135M on CPU; 3 with offload 'optimizer_and_params'; else 2. The run's config.yaml records "
            "the stage chosen, so a resume or a fork keeps it."
        ),
    )
    micro_batch_size: int = Field(16, ge=1, description="Samples per forward/backward on each rank.")
    train_batch_size: Optional[int] = Field(
        None, ge=1, description="Samples per optimizer step over all ranks; None = the whole rollout batch."
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    shuffle: Literal["groups", "rows"] = Field(
        "groups",
        description=(
            "What each epoch shuffles before cutting it into optimizer steps: 'groups' keeps the samples of a prompt "
            "together (a seeded order of the groups, as verl's mini-batches of whole prompts), so a micro-batch "
            "runs each of its prompts' shared tokens once (engines/trainer/shared_prompt.py) and each step holds "
            "whole groups; 'rows' shuffles samples one by one (OpenRLHF's and TRL's), so a step's micro-batches "
            "hold samples of more prompts. The same with rollout.n_samples 1."
        ),
    )
    actor_lr: float = Field(1e-5, gt=0, description="Actor learning rate.")
    critic_lr: float = Field(1e-5, gt=0, description="Critic learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up in optimizer steps.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR schedule after warm-up.")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="Gradient max-norm clip; None = off.")
    mask_truncated: bool = Field(
        False,
        description=(
            "Leave samples cut off at rollout.max_new_tokens (finish_reason 'length') out of the loss (DAPO's "
            "overlong filtering); they still count in their group's baseline."
        ),
    )
    logprob_chunk: int = Field(
        128, ge=1, description="Token rows (over all sequences) per chunk of the selective log-softmax."
    )
    offload: Literal["none", "optimizer", "optimizer_and_params"] = Field(
        "none",
        description=(
            "DeepSpeed ZeRO offload to CPU memory: 'optimizer' (offload_optimizer, ZeRO stage 1-3) keeps the fp32 "
            "master weights and AdamW state on the CPU and steps there; 'optimizer_and_params' (also offload_param, "
            "ZeRO stage 3 only) keeps the parameter partitions there too. The step runs torch's AdamW on CPU "
            "tensors (DeepSpeedCPUAdam would need a JIT-compiled op). On a CPU-only machine everything already "
            "lives in CPU memory: DeepSpeed accepts the setting, and it moves nothing."
        ),
    )

    num_ranks: int = Field(
        1,
        ge=1,
        le=512,
        description=(
            "Data-parallel ranks of the update stage, a torchrun group that is the warm update worker (gloo on "
            "CPU, NCCL with one GPU per rank): `ppoflow train` starts one on this machine itself, or serve the "
            "run with `torchrun --nproc-per-node=N --no-python ppoflow worker --stage update --stage checkpoint` "
            "(--nnodes for several machines) and pipeline.stage_workers. Each rank trains on its share of every "
            "optimizer step; the loss is the token mean over all ranks' tokens. 1 = no other process."
        ),
    )

    optimizer_state_every: int = Field(
        1,
        ge=1,
        description=(
            "Checkpoint the optimizer state (AdamW's two moments and the fp32 master weights: three quarters of a "
            "float32 checkpoint's bytes) every N-th iteration and at the run's last; the others hold the weights, RNG and the trainer's "
            "small state. A resume at one of those rebuilds the optimizer state by running the updates since the "
            "last full checkpoint again on their scored shards (stages/update_replay.py), exact where the update "
            "is deterministic. 1 = every checkpoint holds it."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        removed = sorted(set(data) & set(_REMOVED_RANK_FIELDS)) if isinstance(data, dict) else []
        if removed:
            fields = ", ".join(f"train.{name}" for name in removed)
            raise ValueError(
                f"{fields}: removed with ppoflow's own rank group. The update ranks are a torchrun group, whose "
                f"rendezvous, agents and restarts do that work (remove the field; for several nodes start `torchrun "
                f"--nnodes=N --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --no-python ppoflow worker --stage update "
                f"--stage checkpoint` on each and list update and checkpoint in pipeline.stage_workers)"
            )
        return data

    @model_validator(mode="after")
    def _check_optimizer_state_every(self) -> "TrainConfig":
        if self.optimizer_state_every > 1 and self.num_ranks > 1:
            raise ValueError(
                f"train.optimizer_state_every={self.optimizer_state_every} with train.num_ranks={self.num_ranks}: "
                f"rebuilding the optimizer state by replaying updates runs on one rank only; set "
                f"train.optimizer_state_every=1 (every checkpoint holds the optimizer state) for several ranks"
            )
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> "TrainConfig":
        if self.zero_stage is None:  # PPOFlowConfig chooses it (default_zero_stage), offload included
            return self
        if self.offload != "none" and self.zero_stage == 0:
            raise ValueError(
                f"train.offload={self.offload!r} needs train.zero_stage 1, 2 or 3 (got 0): ZeRO offload "
                f"moves the optimizer partitions, which stage 0 does not have"
            )
        if self.offload == "optimizer_and_params" and self.zero_stage != 3:
            raise ValueError(
                f"train.offload='optimizer_and_params' needs train.zero_stage=3 (got {self.zero_stage}): "
                f"only ZeRO-3 partitions the parameters; use train.offload='optimizer' below stage 3"
            )
        return self


def default_zero_stage(dtype: str, offload: str) -> int:
    """The ZeRO stage for train.zero_stage None: 0 for float32 weights without offload, 3 for offload
    'optimizer_and_params' (the only stage that partitions parameters), else 2.

    Why 0 for float32: ZeRO 1-2 keep an fp32 master copy of every trainable weight, an exact duplicate when the
    weights are float32, and ZeRO-2 copies each micro-batch's gradients into its flat partition. On SmolLM2-135M
    on the 2-core CPU those copies took 5 s of a 20.7 s update (stage 0: 15.5 s, 1.1 GiB less memory, the same
    rewards). Stage 0 replicates the optimizer state on every rank; set 1-3 explicitly to partition it."""
    if offload == "optimizer_and_params":
        return 3
    return 0 if dtype == "float32" and offload == "none" else 2
