"""eval:, signal:, mismatch: and pipeline: -- what runs around the stages and where they run."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from ppoflow.config.base import MAX_STALENESS, _require_stage, _Section

MAX_RETRIES = 10  # a stage that fails more often than this has a bug, not bad luck; warm workers serve this many


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
    retries: int = Field(
        2, ge=0, le=MAX_RETRIES, description="Task retries for each stage, wherever it runs (tasks/retries.py)."
    )
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
