"""reward: and score: -- the reward sources and how the score stage runs them."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from ppoflow.config.base import _Section


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
