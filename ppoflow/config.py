"""The one typed configuration of a ppoflow run.

A run is described by `PPOFlowConfig`: loaded from YAML (`load_config`), overridden from the command
line with dotted keys (`--set algo.kl_coef=0.02`), validated before any work starts, and saved with the
run (`<root>/<run>/config.yaml`) and inside every checkpoint.

Defaults follow OpenRLHF where it is sound: gamma = lambda = 1, value clip 0.5, reward clip +-10,
k1 KL estimator folded into the reward.

Every field carries a description; `ppoflow config-reference` prints them as docs/config-reference.md's table.
A validation error names the dotted field, the value given and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from ppoflow.algorithms import AGG_MODES, ALGO_NAMES, GROUP_ALGOS, get_algorithm, resolve_loss_agg
from ppoflow.rm_config import RMTrainConfig

# The stages an iteration runs, in order; `pipeline.stage_pools` keys must be among them.
PIPELINE_STAGES = ("rollout", "score", "update", "checkpoint", "eval")
MAX_STALENESS = 8  # pipeline.max_staleness: iterations in flight beyond the one updating
# Run names that would put a run where it does not belong: `.` is the root itself (the run would mix with the
# shared score cache under <root>/cache), `..` its parent, `cache` the shared score cache folder.
RESERVED_RUN_NAMES = (".", "..", "cache")


def _takes_float(annotation: Any) -> bool:
    """True for `float` and `Optional[float]` field annotations."""
    union = typing.get_origin(annotation) is typing.Union
    return annotation is float or (union and float in typing.get_args(annotation))


# Fields of ppoflow's own multi-node rank group, removed with it (issue 36): a config that still sets one is refused
# by name. torchrun's rendezvous (--rdzv-endpoint), its agents and --max-restarts do what they did.
_REMOVED_RANK_FIELDS = (
    "rank_timeout_s",
    "hostfile",
    "master_addr",
    "master_port",
    "rank_agent_join_s",
    "rank_heartbeat_lost_s",
)


class _Section(BaseModel):
    # Unknown keys are errors: a typo in a YAML file must not silently fall back to a default.
    # strict: no silent coercion (`n_samples: true` is not 1, `"3"` is not 3); ints are still accepted for
    # float fields. allow_inf_nan=False: a NaN weight or an infinite coefficient is refused, not trained on.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _floats_written_as_text(cls, data: Any) -> Any:
        # PyYAML reads YAML 1.1, where `1e-5` (no dot) is a string; a float field takes it as the number the
        # user meant. Only float fields, and only text that parses as a number ("nan" is then refused).
        if not isinstance(data, dict):
            return data
        fixed = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is not None and isinstance(value, str) and _takes_float(field.annotation):
                try:
                    fixed[name] = float(value)
                except ValueError:
                    pass
        return fixed


class RunConfig(_Section):
    name: str = Field("demo", description="Run name; the run's folder is <root>/<name>.", pattern=r"^[A-Za-z0-9._-]+$")
    root: str = Field(
        "./runs", description="Storage root as a path or fsspec URL (./runs, file:///x, s3://bucket/prefix)."
    )
    iterations: int = Field(10, ge=1, description="Total PPO iterations; a resumed run continues from LATEST + 1.")
    seed: int = Field(0, description="Seed for sampling, initialisation and data order.")
    keep_checkpoints: int = Field(2, ge=1, description="Committed checkpoints kept; the latest is never removed.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if name in RESERVED_RUN_NAMES or len(name) > 64:
            raise ValueError(
                f"must be a plain folder name of 1-64 characters [A-Za-z0-9._-], not one of "
                f"{', '.join(repr(n) for n in RESERVED_RUN_NAMES)} (they name the root, its parent "
                f"or the shared score cache)"
            )
        return name


class StorageConfig(_Section):
    endpoint_url: Optional[str] = Field(None, description="S3 endpoint URL (MinIO, moto, Ceph); None = AWS.")
    region: Optional[str] = Field(None, description="S3 region.")
    profile: Optional[str] = Field(
        None, description="AWS profile; credentials otherwise from the usual AWS_* variables."
    )
    shard_max_rows: int = Field(4096, ge=1, description="Rows per Arrow part before a new part starts.")
    shard_max_bytes: int = Field(
        256 * 2**20, ge=1024, description="Bytes per Arrow part (approximate) before a new part starts."
    )
    multipart_chunk_bytes: int = Field(
        50 * 2**20,
        ge=5 * 2**20,
        description="S3 multipart chunk size; objects of 2x this or more go up as a multipart upload (aborted on failure).",
    )
    local_cache_dir: Optional[str] = Field(
        None,
        description="Local folder for copies of remote checkpoints (vLLM/transformers need local folders), under checkpoints/<run name>/; None = $PPOFLOW_CACHE, else ~/.cache/ppoflow.",
    )
    checkpoint_cache_keep: int = Field(
        2,
        ge=1,
        description="Copies of remote checkpoints kept per run in the local cache, most recently used first; older ones are deleted after each load (each copy is a whole checkpoint, or the parts a worker fetched).",
    )

    def fsspec_options(self) -> dict[str, Any]:
        """Keyword arguments for `fsspec.filesystem("s3", ...)`; empty for AWS defaults."""
        opts: dict[str, Any] = {}
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        if client:
            opts["client_kwargs"] = client
        if self.profile:
            opts["profile"] = self.profile
        return opts


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


class CurriculumConfig(_Section):
    """data.reasoning_gym.curriculum: climb the task's own reasoning-gym curriculum (engines/curriculum.py)."""

    levels: Optional[list[dict[str, Annotated[int, Field(ge=0)]]]] = Field(
        None,
        description="Level L of the run = levels[L], the curriculum attributes' own level indices ({num_terms: 1, "
        "num_digits: 0} for basic_arithmetic; attributes left out stay at their default level). None = reasoning-gym's "
        "global level: level L sets every attribute to min(L, its last level).",
    )
    start_level: int = Field(0, ge=0, description="The level iteration 1 trains at.")
    target_level: int = Field(
        ge=0,
        description="The level of the held-out set (eval.data_path): fixed, so eval accuracy compares across iterations.",
    )
    max_level: Optional[int] = Field(
        None, ge=0, description="The highest level training climbs to; None = target_level."
    )
    promote_at: float = Field(
        0.5,
        ge=0,
        description="Move up a level when the training reward mean at the current level is >= this for "
        "promote_after iterations in a row (the reward is a measured accuracy for 0/1 task scorers).",
    )
    promote_after: int = Field(2, ge=1, description="Iterations in a row at or above promote_at before moving up.")
    range_mode: Literal["inclusive", "upper_bound"] = Field(
        "upper_bound",
        description="How an attribute's level becomes a range (reasoning-gym's RangeAttributeMode): upper_bound = "
        "exactly that level's value (3 terms), inclusive = the first level's value up to it (2 to 3 terms).",
    )

    @model_validator(mode="after")
    def _levels_in_order(self) -> "CurriculumConfig":
        top = self.max_level if self.max_level is not None else self.target_level
        if self.start_level > top:
            raise ValueError(f"start_level={self.start_level} is above the top level {top} (max_level or target_level)")
        if self.levels is not None:
            for name, level in (
                ("start_level", self.start_level),
                ("target_level", self.target_level),
                ("max_level", top),
            ):
                if level >= len(self.levels):
                    raise ValueError(f"{name}={level} has no entry in levels (levels 0..{len(self.levels) - 1})")
        return self

    @property
    def top_level(self) -> int:
        """The highest level training moves to."""
        return self.max_level if self.max_level is not None else self.target_level


class ReasoningGymConfig(_Section):
    task: str = Field(
        description="A reasoning-gym task name (reasoning_gym.factory.DATASETS), e.g. chain_sum, basic_arithmetic, gsm_symbolic."
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's own config fields (its *Config dataclass), e.g. {min_terms: 2, max_terms: 2}; checked by reasoning-gym.",
    )
    size: int = Field(4000, ge=1, description="Training rows (entries seed .. seed + size - 1 of the task).")
    seed: int = Field(1, ge=0, description="The task's seed: entry i is drawn from Random(seed + i).")
    eval_size: int = Field(
        0,
        ge=0,
        description="Held-out rows for the eval stage (eval.data_path is set to them): drawn from eval_seed on, none whose question is among the training rows; 0 = no held-out set.",
    )
    eval_seed: Optional[int] = Field(
        None, ge=0, description="Seed of the held-out rows; None = seed + size (no shared draws)."
    )
    prompt_template: str = Field(
        "{question}",
        description="The prompt text around the task's question ({question}); the chat template comes after, from model.apply_chat_template.",
    )

    curriculum: Optional[CurriculumConfig] = Field(
        None,
        description="{start_level, target_level, promote_at, promote_after, levels, max_level, range_mode}: train on "
        "the task's reasoning-gym curriculum, moving up a level when the training reward passes promote_at; the "
        "held-out set is at target_level. config holds the task's other fields. None = config as given, no levels.",
    )

    @model_serializer(mode="wrap")
    def _without_unset_curriculum(self, handler):
        # Without a curriculum the spec dumps as before it existed: its data folder's hash and cache keys stay.
        data = handler(self)
        if isinstance(data, dict) and data.get("curriculum", 0) is None:
            del data["curriculum"]
        return data

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, template: str) -> str:
        if "{question}" not in template:
            raise ValueError("must contain {question} (where the task's question goes)")
        try:
            template.format(question="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"is not a format string with only {{question}} in it: {e}") from None
        return template


class DataConfig(_Section):
    path: str = Field(
        "./runs/_data/digits",
        description="A datasets folder (save_to_disk), or a .jsonl/.parquet file; set by ppoflow when data.reasoning_gym is given.",
    )
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: Optional[str] = Field(
        "label", description="Column passed to reward functions as the label / ground truth."
    )
    data_source_key: Optional[str] = Field(
        None, description="Column passed to veRL-style compute_score as data_source."
    )
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts longer than this are an error naming the row.")
    reasoning_gym: Optional[ReasoningGymConfig] = Field(
        None,
        description="Generate the prompts with a reasoning-gym task instead of reading a file: {task, config, size, seed, eval_size, eval_seed, prompt_template}; written once as .jsonl under <root>/_data/reasoning-gym/ (data.path and, with eval_size, eval.data_path point there; columns prompt, label = the task's entry as JSON, data_source = the task). Score with engines.rewards.reasoning_tasks (the task's own score_answer). None = data.path.",
    )


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


class RewardSourceConfig(_Section):
    kind: Literal["function", "model", "remote", "environment"] = Field(
        description="function: path/to/file.py:fn or pkg.module:fn; model: a sequence-classification folder; remote: an HTTP reward server; environment: the rollout environment's summed reward (rollout.environment)."
    )
    target: str = Field("", description="The function spec, model folder or server URL (none for environment).")
    weight: float = Field(1.0, description="Weight of this source in the summed reward.")
    name: Optional[str] = Field(None, description="Component name in metrics and shards; defaults to kind.")
    timeout_s: float = Field(60.0, gt=0, description="Per-call timeout (function and remote sources).")
    isolation: Literal["thread", "process"] = Field(
        "thread",
        description="function: run it in a worker thread, or in a worker process that is killed on a timeout (for code that may hang).",
    )
    batch_size: int = Field(64, ge=1, description="Samples per call to this source.")
    token_env: str = Field("PPOFLOW_REWARD_TOKEN", description="remote: environment variable holding the bearer token.")
    max_retries: int = Field(
        3,
        ge=0,
        description="remote: retries with exponential backoff on 5xx, timeouts and connection errors; 4xx fails at once.",
    )
    quantize: Literal["none", "int8-dynamic", "bnb-8bit", "bnb-4bit"] = Field(
        "none", description="model: int8 dynamic quantization on CPU, bitsandbytes on GPU."
    )

    @model_validator(mode="after")
    def _target_fits_kind(self) -> "RewardSourceConfig":
        # The shape of the target only; preflight checks that the file, folder or module is there.
        if self.kind == "function":
            where, _, fn = self.target.rpartition(":")
            if not where or not fn:
                raise ValueError(
                    f"target={self.target!r}: a function source needs 'path/to/file.py:fn' or 'pkg.module:fn'"
                )
        elif self.kind == "remote" and not self.target.startswith(("http://", "https://")):
            raise ValueError(f"target={self.target!r}: a remote source needs an http:// or https:// URL")
        elif self.kind == "environment":
            if self.target:
                raise ValueError(
                    f"target={self.target!r}: an environment source reads the rollout's env_reward and takes no "
                    f"target (the environment is rollout.environment.source)"
                )
        elif not self.target:
            raise ValueError("target='': a model source needs a reward-model folder")
        return self


class OverlongConfig(_Section):
    buffer: int = Field(
        ge=1, description=("Tokens before rollout.max_new_tokens where the penalty ramps up linearly (DAPO's L_cache).")
    )
    penalty: float = Field(
        1.0, gt=0, description=("Penalty at the cap: a response of max_new_tokens tokens gets reward - penalty.")
    )


class RewardConfig(_Section):
    sources: list[RewardSourceConfig] = Field(
        default_factory=lambda: [RewardSourceConfig(kind="function", target="engines.toy.task:reward_func")],
        min_length=1,
        description="Reward sources, summed with their weights.",
    )
    clip: float = Field(10.0, gt=0, description="Scalar reward clipped to [-clip, clip].")
    overlong: Optional[OverlongConfig] = Field(
        None,
        description=(
            "{buffer, penalty}: DAPO's soft overlong punishment, added to the reward in the update: 0 up to "
            "max_new_tokens - buffer tokens, then falling linearly to -penalty at max_new_tokens; None = off."
        ),
    )
    normalize: Literal["none", "running"] = Field(
        "none",
        description=(
            "running: (reward - mean) / std with the mean and std of every reward the trainer has seen (saved with "
            "the trainer state); applied before the overlong penalty and the advantages."
        ),
    )

    @model_validator(mode="after")
    def _distinct_names(self) -> "RewardConfig":
        # Each source's scores are stored under its name (components, shards, metrics): two sources with one name
        # would overwrite each other. Refused here, with the config, not at the first score stage of a run or fork.
        names = [s.name or s.kind for s in self.sources]
        twice = {n: [i for i, m in enumerate(names) if m == n] for n in names if names.count(n) > 1}
        if twice:
            where = "; ".join(f"{n!r} at sources {', '.join(map(str, idx))}" for n, idx in twice.items())
            raise ValueError(
                f"reward.sources: two sources have the same name ({where}; a source without `name` is named by its "
                f"kind); give each a distinct `name`"
            )
        return self


class ScoreConfig(_Section):
    token_budget: int = Field(16384, ge=1, description="Padded tokens per scoring micro-batch (rows sorted by length).")
    cache: bool = Field(True, description="Use the prompt-hash score cache under <root>/cache/score.")
    cache_max_bytes: int = Field(
        2 * 2**30, ge=0, description="Cache size cap per scorer; oldest entries are evicted first."
    )


AlgoName = Literal[ALGO_NAMES]  # the registry's names (ppoflow/algorithms.py)


class AlgoConfig(_Section):
    name: AlgoName = Field(
        "ppo",
        description=(
            "Algorithm (ppoflow/algorithms.py): ppo = GAE with a critic; grpo, dr_grpo, rloo, "
            "reinforce_pp_baseline use groups of rollout.n_samples; none but ppo trains a critic."
        ),
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="KL estimator against the reference.")
    kl_in_reward: bool = Field(
        True, description="Fold the KL penalty into token rewards (PPO); else add it to the loss (GRPO style)."
    )
    kl_coef: float = Field(0.01, ge=0, description="Initial KL coefficient.")
    kl_target: Optional[float] = Field(
        None,
        gt=0,
        description="Adaptive KL controller target: mean KL per response "
        "(summed over its tokens), nats; None = fixed coefficient.",
    )
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL controller horizon (samples).")
    clip_low: float = Field(0.2, ge=0, lt=1, description="Policy ratio clip below 1.")
    clip_high: float = Field(0.2, ge=0, description="Policy ratio clip above 1 (DAPO's clip-higher when larger).")
    dual_clip: Optional[float] = Field(
        None, gt=1, description="Dual-clip constant c > 1 for negative advantages; None = off."
    )
    value_clip: Optional[float] = Field(0.5, gt=0, description="Value clip around old values; None = off.")
    entropy_coef: float = Field(0.0, description="Entropy bonus coefficient.")
    whiten_advantages: bool = Field(True, description="Masked whitening of advantages over the batch.")
    loss_agg: Optional[Literal[AGG_MODES]] = Field(
        None,
        description=(
            "Loss aggregation over an optimizer step: token_mean, seq_mean_token_mean (GRPO paper), "
            "seq_mean_token_sum_norm (Dr. GRPO); None = the algorithm's default (dr_grpo: seq_mean_token_sum_norm, "
            "the others: token_mean)."
        ),
    )
    loss_agg_norm: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "seq_mean_token_sum_norm's constant (Dr. GRPO): token-loss sums are divided by responses * this; "
            "None = rollout.max_new_tokens."
        ),
    )
    tis_cap: Optional[float] = Field(
        None,
        ge=1,
        description=(
            "Truncated importance sampling for the sampler/trainer mismatch: policy-gradient tokens weighted by "
            "min(exp(old_logprobs - rollout_logprobs), tis_cap) (Yao et al. 2025); None = off."
        ),
    )

    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute",
        description=(
            "Where the update's old log-probs (the PPO ratio's denominator, and the KL's policy side) come from: "
            "recompute = a no-grad forward of the actor over the batch before the first step (exact, ~a quarter "
            "of an update's compute when the batch is several optimizer steps); rollout = the sampler's own "
            "log-probs of the tokens it drew (no forward; the ratio is then against the sampling policy, so it "
            "also covers samples from an older policy, as in textbook off-policy PPO, and carries the "
            "sampler/trainer numeric mismatch)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "vf_coef" in data:
            raise ValueError(
                "algo.vf_coef was removed: actor and critic are separate DeepSpeed engines, each with "
                "its own AdamW and grad clip, so a value-loss weight would only rescale the critic's "
                "loss (Adam undoes that); tune train.critic_lr instead"
            )
        return data

    @model_validator(mode="after")
    def _check_group_discount(self) -> "AlgoConfig":
        if get_algorithm(self.name).needs_groups and self.gamma != 1.0:
            raise ValueError(
                f"algo.gamma={self.gamma} with algo.name={self.name!r}: the group algorithms "
                f"{GROUP_ALGOS} give one score per response, so they need algo.gamma = 1"
            )
        return self

    @model_validator(mode="after")
    def _check_kl_loss_estimator(self) -> "AlgoConfig":
        # In the loss, k1 = log pi - log pi_ref has gradient grad log pi, whose expectation under the sampling
        # policy is 0: the term adds noise, not a pull towards the reference. In the reward k1 is the usual choice.
        kl_on = self.kl_coef > 0 or self.kl_target is not None
        if kl_on and not self.kl_in_reward and self.kl_estimator == "k1":
            raise ValueError(
                "algo.kl_estimator='k1' with algo.kl_in_reward=false: as a loss term k1 has zero expected "
                "gradient (only noise); use algo.kl_estimator=k3 (the GRPO paper's) or k2 for the KL in the "
                "loss, or algo.kl_in_reward=true to keep k1 in the reward"
            )
        return self

    @model_validator(mode="after")
    def _check_old_logprobs(self) -> "AlgoConfig":
        if self.old_logprobs == "rollout" and self.tis_cap is not None:
            raise ValueError(
                f"algo.tis_cap={self.tis_cap} with algo.old_logprobs='rollout': the importance weight "
                "exp(old_logprobs - rollout_logprobs) is then 1 on every token (the old log-probs ARE the "
                "sampler's); drop algo.tis_cap, or use algo.old_logprobs=recompute to correct the mismatch"
            )
        return self

    @model_validator(mode="after")
    def _check_loss_agg_norm(self) -> "AlgoConfig":
        if self.loss_agg_norm is not None and self.resolved_loss_agg != "seq_mean_token_sum_norm":
            raise ValueError(
                f"algo.loss_agg_norm={self.loss_agg_norm} is only used by loss_agg "
                f"seq_mean_token_sum_norm, but algo.loss_agg resolves to {self.resolved_loss_agg!r}"
            )
        return self

    @property
    def uses_critic(self) -> bool:
        return get_algorithm(self.name).uses_critic

    @property
    def resolved_loss_agg(self) -> str:
        """algo.loss_agg, or the algorithm's default when it is None."""
        return resolve_loss_agg(self.name, self.loss_agg)


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


class EvalConfig(_Section):
    data_path: Optional[str] = Field(
        None,
        description=(
            "Held-out prompts (a datasets folder, .jsonl or .parquet with data's columns); None = no eval stage."
        ),
    )
    every: int = Field(1, ge=1, description="Evaluate after every `every`-th iteration's checkpoint, and the last.")
    n_samples: int = Field(1, ge=1, description="Responses per held-out prompt; eval/pass@k uses k = n_samples.")
    temperature: float = Field(
        0.0, ge=0, description="Sampling temperature of the eval; 0 = greedy (top-k 1, as vLLM and HF both honour)."
    )
    max_new_tokens: Optional[int] = Field(None, ge=1, description="Response length cap; None = rollout.max_new_tokens.")
    before_training: bool = Field(
        False,
        description="Also evaluate the initial policy when a run starts (before iteration 1): its metrics are the row of iteration 0 in metrics.jsonl, the table and the plot, its shards iter-000000/eval/.",
    )
    sampled_pass_at_k: Literal["never", "before_training", "every"] = Field(
        "before_training",
        description="Also sample rollout.n_samples responses per held-out prompt at the rollout's temperature and report "
        "eval/sampled_pass@k (k = rollout.n_samples) and eval/sampled_spread (the share of prompts whose samples "
        "differ: the groups GRPO could learn from) beside the greedy figures: in the initial eval, in every eval, or "
        "never. Costs rollout.n_samples more samples per held-out prompt.",
    )


def _require_stage(stage: str) -> None:
    """ValueError naming `stage` and the stages when it is not a pipeline stage (a typo in a per-stage setting)."""
    if stage not in PIPELINE_STAGES:
        raise ValueError(f"unknown stage {stage!r}; the stages are {', '.join(PIPELINE_STAGES)}")


class SignalConfig(_Section):
    """When the groups stop carrying a learning signal: the one-line advice of flows/signal_advice.py."""

    advice_below: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Say once what to try when signal/group_spread (the share of prompt groups whose rewards differ) "
        "stays below this for advice_after iterations in a row; 0 = never.",
    )
    advice_after: int = Field(3, ge=1, description="Iterations in a row below advice_below before the advice.")


class MismatchConfig(_Section):
    """The train/inference mismatch gate (stages/mismatch_gate.py): how far the sampler's log-probs may be from the
    trainer's for the same weights and tokens before the update stage warns or fails."""

    max_logprob_diff_mean: Optional[float] = Field(
        None,
        gt=0,
        description="Largest allowed mismatch/logprob_abs_diff_mean (nats per policy token). None: 1e-3 when the run "
        "computes in float32 (model.dtype float32, no model.autocast_dtype), where sampler and trainer agree to "
        "rounding (measured in the docs), else no limit (the metric is still reported).",
    )
    max_kl: Optional[float] = Field(
        None, gt=0, description="Largest allowed mismatch/kl (k3 estimate of KL(sampler || trainer) per token)."
    )
    action: Literal["warn", "fail"] = Field(
        "fail",
        description="Past a limit: 'fail' the update stage by name (nothing is committed), or 'warn' in the log.",
    )


class StageDeadlinesConfig(_Section):
    """How long a stage may run, or wait to be taken, before it fails by name (tasks/deadlines.py)."""

    enabled: bool = Field(True, description="Give every stage a deadline; false = stages may run for ever.")
    factor: float = Field(
        5.0, gt=1, description="A stage's deadline is this many times the median of its recent durations."
    )
    history: int = Field(
        5, ge=1, description="Recent iterations (metrics rows with timing/<stage>) the median is over."
    )
    floor_s: float = Field(
        300.0, gt=0, description="The derived deadline is never shorter than this (a noisy machine, short stages)."
    )
    first_s: float = Field(
        1800.0,
        gt=0,
        description="Added the first time a process runs a stage (engine start-up, model load, compilation), and "
        "the whole deadline while the run has no duration of the stage yet. Raise it for a big model's first iteration.",
    )
    grace_s: float = Field(
        60.0,
        gt=0,
        description="After the deadline the stage is interrupted; one still running this long later (blocked in "
        "native code) ends its process with a message naming it, and the run resumes from its last checkpoint.",
    )
    pickup_s: float = Field(
        60.0,
        ge=0,
        description="A stage sent to warm workers or a work pool fails when no worker or pool worker has been "
        "there to take it for this long.",
    )
    stages: dict[str, float] = Field(
        default_factory=dict,
        description="Fixed deadline in seconds per stage (rollout, score, update, checkpoint, eval), replacing the "
        "derived one; 0 = no deadline for that stage.",
    )

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, stages: dict[str, float]) -> dict[str, float]:
        for stage, seconds in stages.items():
            _require_stage(stage)
            if seconds < 0:
                raise ValueError(f"stage {stage!r}: a deadline is seconds >= 0 (0 = none), not {seconds}")
        return stages


class PipelineConfig(_Section):
    stage_pools: Optional[dict[str, str]] = Field(
        None,
        description="Stage -> deployment as FLOW/DEPLOYMENT, e.g. {rollout: ppo-rollout/ppo-rollout} as prefect.yaml creates them; None = all stages in-process.",
    )
    retries: int = Field(2, ge=0, description="Task retries for each stage.")
    retry_delay_s: float = Field(5.0, ge=0, description="First retry delay; doubles each retry.")
    stage_workers: list[Literal["rollout", "score", "update", "checkpoint"]] = Field(
        default_factory=list,
        description="Stages sent to warm Prefect task workers (`ppoflow worker --stage S`), "
        "which keep their engines between iterations; [] = none.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=MAX_STALENESS,
        description="Pipelined iterations: k >= 1 runs the rollout and score of iterations i+1..i+k while iteration "
        "i updates; iteration i samples with the policy committed at i-1-k (fixed schedule, so runs stay "
        "reproducible and resumable) and its update corrects for the stale samples (decoupled PPO, importance "
        "weights capped at algo.tis_cap, 2.0 when unset). 0 = one iteration after another.",
    )
    rollout_parts: int = Field(
        1,
        ge=1,
        description="Data-parallel rollout: split each iteration's prompts into this many parts, each its own "
        "stage task run (cached and retried alone), one after another in-process or spread over the warm rollout "
        "workers (several `ppoflow worker --stage rollout`), then merged into one rollout manifest. The samples do "
        "not depend on it (per-prompt seeds). 1 = one rollout task run.",
    )
    deadlines: StageDeadlinesConfig = Field(
        default_factory=StageDeadlinesConfig,
        description="Stage deadlines and how long a stage may wait for a worker (docs: When things fail).",
    )

    @field_validator("stage_pools")
    @classmethod
    def _known_stages(cls, pools: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        # A typo in a key used to run that stage in-process without a word; preflight checks that the named
        # deployments exist on the Prefect server.
        for stage, deployment in (pools or {}).items():
            _require_stage(stage)
            flow_name, _, name = deployment.partition("/")
            if not flow_name or not name or "/" in name:
                raise ValueError(
                    f"stage {stage!r}: deployment {deployment!r} must be 'flow-name/deployment-name' "
                    f"(e.g. 'ppo-{stage}/ppo-{stage}')"
                )
        return pools


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


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field, the value and what is allowed."""


def _format_validation_error(err: ValidationError, origin: str) -> str:
    """One line per problem: `field = value (type): what is allowed`; checks across fields name their own."""
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        given = e.get("input")
        if not field or isinstance(given, dict):  # a check over a whole section: its message names the fields
            lines.append(f"  {field + ': ' if field else ''}{msg}")
            continue
        given_s = json.dumps(given, default=str)[:80]
        if e["type"].endswith("_type") or e["type"] == "finite_number":
            given_s += f" ({type(given).__name__})"  # `true` for an int, NaN for a float: say what was given
        lines.append(f"  {field} = {given_s}: {msg}")
    return "\n".join(lines)


def _first_duplicate_key(node: yaml.Node, where: str, seen: set[int]) -> Optional[tuple[str, str, int, int]]:
    """(mapping's dotted path, key, first line, second line) of the first key given twice in one mapping of the
    composed YAML `node`, or None. Merge keys (`<<: *base`) are not keys of their own: a key beside one
    overrides the merged value, as YAML means it. Lines are 1-based."""
    if id(node) in seen:  # an alias of a node already walked
        return None
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        children = [(f"{where}.{i}" if where else str(i), item) for i, item in enumerate(node.value)]
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        children = []
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in lines:
                return where, key, lines[key], line
            lines[key] = line
            children.append((f"{where}.{key}" if where else key, value_node))
    else:
        return None
    for path, child in children:
        if found := _first_duplicate_key(child, path, seen):
            return found
    return None


def _load_yaml(text: str, origin: str, root: str = "") -> Any:
    """yaml.safe_load, but a key given twice in one mapping is a ConfigError naming the key, its section
    (dotted, under `root`) and both lines (PyYAML keeps the last value without a word, so the first one the
    reader sees would silently not count). Raises yaml.YAMLError for text that is not YAML."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and (duplicate := _first_duplicate_key(node, root, set())):
            where, key, first, second = duplicate
            section = f"in {where!r}" if where else "at the top level"
            lines = (f" line {second}", f" (first on line {first})") if "\n" in text.strip() else ("", "")
            raise ConfigError(
                f"{origin}{lines[0]}: key {key!r} is given twice {section}{lines[1]}; "
                f"YAML would keep only the last value: remove one"
            )
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def _parse_value(text: str, origin: str = "--set value", key: str = "") -> Any:
    """`--set` values are YAML scalars: 3, 0.1, true, null, [1, 2], or plain strings."""
    try:
        return _load_yaml(text, origin, key)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = _parse_value(raw, f"override {item!r}", key.strip())
    return data


def build_config(data: dict[str, Any], origin: str = "<dict>") -> PPOFlowConfig:
    try:
        return PPOFlowConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, origin)) from None


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> PPOFlowConfig:
    """Load a YAML config (or defaults when path is None), apply `--set` overrides, validate.

    ConfigError for a missing file, text that is not YAML, a key given twice in one mapping (naming the key and
    both lines), or a value that does not validate (naming the field)."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        try:
            data = _load_yaml(Path(path).read_text(), f"config file {path}") or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    if overrides:
        apply_overrides(data, overrides)
        origin += " + --set"
    return build_config(data, origin)


def as_config(config: PPOFlowConfig | dict[str, Any]) -> PPOFlowConfig:
    """Flows receive the config as a model or as its JSON form (deployments, run_deployment): validate the latter.
    ConfigError with the CLI's message (one line per problem, naming the field), which becomes the run's state."""
    return config if isinstance(config, PPOFlowConfig) else build_config(config, "the flow run's config parameter")
