"""rollout: -- how responses are sampled: engine, batch, dynamic sampling, multi-turn environments."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, field_validator, model_serializer

from ppoflow.config.base import _Section


class DynamicSamplingConfig(_Section):
    enabled: bool = Field(
        False,
        description=(
            "DAPO dynamic sampling: drop groups whose rollout.n_samples rewards are all equal (zero advantage) and "
            "sample more prompts until prompts_per_iteration groups with variance are collected. With "
            "reward.overlong, equal rewards with different overlong penalties count as variance (the advantages "
            "see reward + penalty), where DAPO's accuracy filter drops them; the KL of algo.kl_in_reward is not "
            "looked at."
        ),
    )
    max_rounds: int = Field(
        4,
        ge=1,
        description=(
            "Sampling rounds per iteration at most, the iteration's own prompts included; when they run out the "
            "update trains on the groups kept, cut to whole optimizer steps (rollout/batch_filled = 0)."
        ),
    )


class EnvironmentConfig(_Section):
    """A multi-turn environment (engines/environments/base.py): one instance per sample, stepped after every
    policy turn; its observations are context, its rewards reach the score through reward kind "environment"."""

    source: str = Field(
        description="The environment factory: 'path/to/file.py:Factory' or 'pkg.module:Factory', called with no arguments once per sample."
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="Policy turns per sample at most; an episode still running then is truncated (truncation 'max_turns').",
    )
    max_total_tokens: int = Field(
        1024,
        ge=2,
        description="Prompt plus every turn's tokens per sample at most; a turn is cut, or an observation left out, where it would pass this (truncation 'max_total_tokens').",
    )
    max_failed_group_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="A sample whose environment fails (EnvironmentFailed) drops its whole group of n samples from the "
        "rollout (never trained partially: a partial group biases its baseline); more than this share of the "
        "iteration's groups failing fails the rollout stage, naming the environment, the rows and the first error. "
        "0 = any failure fails the stage.",
    )

    @field_validator("source")
    @classmethod
    def _factory_spec(cls, source: str) -> str:
        where, _, name = source.rpartition(":")
        if not where or not name:
            raise ValueError(f"{source!r}: an environment needs 'path/to/file.py:Factory' or 'pkg.module:Factory'")
        return source


class RolloutConfig(_Section):
    engine: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="Generation engine; auto = vLLM when installed, else HF generate."
    )
    prompts_per_iteration: int = Field(32, ge=1, description="Prompts drawn from the dataset per iteration.")
    n_samples: int = Field(4, ge=1, description="Responses sampled per prompt (GRPO/RLOO groups).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; log-probs are taken at the same temperature."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 = off.")
    max_new_tokens: int = Field(16, ge=1, description="Response length cap.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="Extra stop tokens besides EOS."
    )
    # vLLM engine settings
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism (GPU).")
    gpu_memory_utilization: float = Field(
        0.1, gt=0, le=1, description="vLLM memory fraction; on CPU the share of host RAM reserved for KV cache."
    )
    max_model_len: Optional[int] = Field(None, ge=1, description="vLLM context length; None = the model's.")
    enforce_eager: bool = Field(True, description="Disable CUDA graphs / compilation in vLLM (always on CPU).")
    kv_cache_space_gib: Optional[float] = Field(
        None,
        gt=0,
        description="vLLM on CPU: GiB of host RAM for the KV cache (like VLLM_CPU_KVCACHE_SPACE); None = gpu_memory_utilization's share.",
    )
    sleep_between_iterations: bool = Field(
        False, description="GPU only: vLLM sleep/wake around the update when it shares a GPU with training."
    )
    engine_replacements: int = Field(
        1,
        ge=0,
        description="How many times a rollout or eval stage builds its engine again when the engine's process dies under it (vLLM's EngineCore killed, out of memory, a segfault); the stage's requests run again with the same seeds, so its rows are an uninterrupted stage's. One more death fails the stage naming the engine and this field. 0 = the first death fails it.",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="DAPO dynamic sampling (zero-variance group filter)."
    )
    environment: Optional[EnvironmentConfig] = Field(
        None,
        description="{source, max_turns, max_total_tokens}: multi-turn rollout against an environment (needs model.apply_chat_template); None = single-turn.",
    )

    @model_serializer(mode="wrap")
    def _without_unset_environment(self, handler):
        # A single-turn config dumps exactly as before multi-turn existed: its config.yaml, shard metadata, config
        # hashes and stage cache keys stay byte for byte the same.
        data = handler(self)
        if isinstance(data, dict) and data.get("environment", 0) is None:
            del data["environment"]
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, top_k: int) -> int:
        if top_k == 0:
            raise ValueError("must be -1 (off) or >= 1 (0 would keep no token)")
        return top_k
