"""PPOFlowConfig: the whole run, its sections and the checks across them."""

from __future__ import annotations

import hashlib
import json

import yaml
from pydantic import Field, model_validator

from ppoflow.algorithms import get_algorithm
from ppoflow.config.algo import AlgoConfig
from ppoflow.config.base import _Section
from ppoflow.config.data import DataConfig
from ppoflow.config.model import ModelConfig
from ppoflow.config.pipeline import EvalConfig, MismatchConfig, PipelineConfig, SignalConfig
from ppoflow.config.reward import RewardConfig, ScoreConfig
from ppoflow.config.rollout import RolloutConfig
from ppoflow.config.run import RunConfig, StorageConfig
from ppoflow.config.train import TrainConfig, default_zero_stage
from ppoflow.rm_config import RMTrainConfig


class PPOFlowConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    rm_train: RMTrainConfig = Field(default_factory=RMTrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    signal: SignalConfig = Field(default_factory=SignalConfig)
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)

    @model_validator(mode="after")
    def _choose_zero_stage(self) -> "PPOFlowConfig":
        if self.train.zero_stage is None:
            self.train.zero_stage = default_zero_stage(self.model.dtype, self.train.offload)
        return self

    @model_validator(mode="after")
    def _check_consistency(self) -> "PPOFlowConfig":
        if get_algorithm(self.algo.name).needs_groups and self.rollout.n_samples < 2:
            raise ValueError(
                f"algo.name={self.algo.name!r} needs rollout.n_samples >= 2 (got {self.rollout.n_samples})"
            )
        batch = self.rollout_batch_size
        tbs = self.train.train_batch_size
        if tbs is not None and (tbs > batch or batch % tbs):
            raise ValueError(
                f"train.train_batch_size={tbs} must divide the rollout batch "
                f"(rollout.prompts_per_iteration * rollout.n_samples = {batch})"
            )
        self._check_recipes()
        self._check_environment()
        overlong = self.reward.overlong
        if overlong is not None and overlong.buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong.buffer={overlong.buffer} must be <= rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens} (the penalty ramps up over the last buffer tokens)"
            )
        # The trainer's rule (engines/trainer/deepspeed_setup.py) for one rank: micro-batches of
        # min(micro_batch_size, train batch) must tile the train batch; several ranks: _check_ranks.
        step_batch = tbs or batch
        micro = min(self.train.micro_batch_size, step_batch)
        if step_batch % micro:
            raise ValueError(
                f"train.micro_batch_size={self.train.micro_batch_size} must divide the train batch of "
                f"{step_batch} samples (train.train_batch_size, else the rollout batch), or be larger"
            )
        self._check_ranks(step_batch)
        return self

    def _check_ranks(self, step_batch: int) -> None:
        """Several ranks: each takes step_batch / num_ranks rows of every step, in micro-batches of
        min(micro_batch_size, that share) that must tile it (deepspeed_setup.deepspeed_config's rule)."""
        ranks = self.train.num_ranks
        if ranks == 1:
            return
        share = step_batch // ranks
        if step_batch % ranks:
            raise ValueError(
                f"train.num_ranks={ranks} must divide the train batch of {step_batch} samples "
                f"(train.train_batch_size, else rollout.prompts_per_iteration * rollout.n_samples): "
                f"every rank takes an equal share of each optimizer step"
            )
        if share % min(self.train.micro_batch_size, share):
            raise ValueError(
                f"train.micro_batch_size={self.train.micro_batch_size} must divide each rank's share of the "
                f"train batch ({step_batch} samples / train.num_ranks={ranks} = {share}), or be larger"
            )

    @model_validator(mode="after")
    def _check_rollout_parts(self) -> "PPOFlowConfig":
        """pipeline.rollout_parts: at least one prompt a part; refused with dynamic sampling and rollout on a pool."""
        parts = self.pipeline.rollout_parts
        if parts == 1:
            return self
        if parts > self.rollout.prompts_per_iteration:
            raise ValueError(
                f"pipeline.rollout_parts={parts} must be <= rollout.prompts_per_iteration="
                f"{self.rollout.prompts_per_iteration}: every part samples at least one prompt"
            )
        if self.rollout.dynamic_sampling.enabled:
            raise ValueError(
                f"pipeline.rollout_parts={parts} with rollout.dynamic_sampling.enabled=true: dynamic sampling draws "
                f"more prompts from the rewards of all the iteration's groups, so it samples in one part; allowed: "
                f"pipeline.rollout_parts=1, or dynamic sampling off"
            )
        if "rollout" in (self.pipeline.stage_pools or {}):
            raise ValueError(
                f"pipeline.rollout_parts={parts} with pipeline.stage_pools.rollout: a rollout on a work pool runs as "
                f"one flow run; allowed: pipeline.rollout_parts=1 there, or the parts on warm workers "
                f"(pipeline.stage_workers: [rollout]) or in-process"
            )
        return self

    def _check_environment(self) -> None:
        """rollout.environment and reward kind "environment" go together; multi-turn needs the chat template."""
        env = self.rollout.environment
        reads_env = [i for i, s in enumerate(self.reward.sources) if s.kind == "environment"]
        if env is None:
            if reads_env:
                raise ValueError(
                    f"reward.sources.{reads_env[0]}.kind='environment' needs rollout.environment (a multi-turn "
                    f"rollout whose environment gives the reward); set it or remove that source"
                )
            return
        if not self.model.apply_chat_template:
            raise ValueError(
                "rollout.environment needs model.apply_chat_template=true: the conversation is built turn by turn "
                "with the tokenizer's chat template"
            )
        if env.max_total_tokens <= self.data.max_prompt_tokens:
            raise ValueError(
                f"rollout.environment.max_total_tokens={env.max_total_tokens} must be > data.max_prompt_tokens="
                f"{self.data.max_prompt_tokens}: a prompt of the allowed length must leave room for a turn"
            )
        if self.reward.overlong is not None:
            raise ValueError(
                "rollout.environment with reward.overlong: the overlong penalty measures one response against "
                "rollout.max_new_tokens, a conversation has several turns (use rollout.environment.max_total_tokens "
                "and train.mask_truncated instead)"
            )

    def _check_recipes(self) -> None:
        """Dynamic sampling needs groups and whole groups per optimizer step; eval on pools needs its deployment."""
        if self.rollout.dynamic_sampling.enabled:
            n, step = self.rollout.n_samples, self.train.train_batch_size or self.rollout_batch_size
            if n < 2:
                raise ValueError(
                    f"rollout.dynamic_sampling.enabled needs rollout.n_samples >= 2 (got {n}): a group of one "
                    f"sample never has reward variance"
                )
            if step % n:
                raise ValueError(
                    f"rollout.dynamic_sampling.enabled needs train.train_batch_size={step} to be a multiple of "
                    f"rollout.n_samples={n} (the filter keeps whole groups)"
                )
        pools = self.pipeline.stage_pools or {}
        if self.eval.data_path and "rollout" in pools and "eval" not in pools:
            raise ValueError(
                "eval.data_path is set and pipeline.stage_pools sends rollout to a pool: name the eval deployment "
                "too (pipeline.stage_pools.eval, e.g. 'ppo-eval/ppo-eval' on the rollout pool, see prefect.yaml)"
            )

    @property
    def loss_agg_norm(self) -> float:
        """seq_mean_token_sum_norm's constant: algo.loss_agg_norm, else the generation budget max_new_tokens."""
        return float(self.algo.loss_agg_norm or self.rollout.max_new_tokens)

    # Derived values, computed from the fields and never stored.
    @property
    def rollout_batch_size(self) -> int:
        return self.rollout.prompts_per_iteration * self.rollout.n_samples

    def section_hash(self, *sections: str) -> str:
        """Stable hash of some sections (for cache keys): changes when any of their fields change."""
        payload = {s: getattr(self, s).model_dump(mode="json") for s in sections}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
