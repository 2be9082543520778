"""The one typed configuration of a ppoflow run.

A run is described by `PPOFlowConfig`: loaded from YAML (`load_config`), overridden from the command
line with dotted keys (`--set algo.kl_coef=0.02`), validated before any work starts, and saved with the
run (`<root>/<run>/config.yaml`) and inside every checkpoint.

Defaults follow OpenRLHF where it is sound: gamma = lambda = 1, value clip 0.5, reward clip +-10,
k1 KL estimator folded into the reward.

One module per section (run and storage, model, data, rollout, reward and score, algo, train, the pipeline's
sections), the whole run in root.py, loading and errors in loading.py; everything is imported from here.

Every field carries a description; `ppoflow config-reference` prints them as docs/config-reference.md's table.
A validation error names the dotted field, the value given and what is allowed.
"""

from ppoflow.config.algo import AlgoConfig
from ppoflow.config.base import MAX_STALENESS, PIPELINE_STAGES, RESERVED_RUN_NAMES
from ppoflow.config.data import CurriculumConfig, DataConfig, ReasoningGymConfig
from ppoflow.config.loading import ConfigError, apply_overrides, as_config, build_config, load_config
from ppoflow.config.model import LoraConfig, ModelConfig, default_model_dtype
from ppoflow.config.pipeline import (
    EvalConfig,
    MismatchConfig,
    PipelineConfig,
    SignalConfig,
    StageDeadlinesConfig,
)
from ppoflow.config.reward import OverlongConfig, RewardConfig, RewardSourceConfig, ScoreConfig
from ppoflow.config.rollout import DynamicSamplingConfig, EnvironmentConfig, RolloutConfig
from ppoflow.config.root import PPOFlowConfig
from ppoflow.config.run import RunConfig, StorageConfig
from ppoflow.config.train import TrainConfig, default_zero_stage

__all__ = [
    "MAX_STALENESS",
    "PIPELINE_STAGES",
    "RESERVED_RUN_NAMES",
    "AlgoConfig",
    "ConfigError",
    "CurriculumConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "EnvironmentConfig",
    "EvalConfig",
    "LoraConfig",
    "MismatchConfig",
    "ModelConfig",
    "OverlongConfig",
    "PPOFlowConfig",
    "PipelineConfig",
    "ReasoningGymConfig",
    "RewardConfig",
    "RewardSourceConfig",
    "RolloutConfig",
    "RunConfig",
    "ScoreConfig",
    "SignalConfig",
    "StageDeadlinesConfig",
    "StorageConfig",
    "TrainConfig",
    "apply_overrides",
    "as_config",
    "build_config",
    "default_model_dtype",
    "default_zero_stage",
    "load_config",
]
