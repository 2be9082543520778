"""algo: -- the RL algorithm: estimator, losses, KL."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from ppoflow.algorithms import AGG_MODES, ALGO_NAMES, GROUP_ALGOS, get_algorithm, resolve_loss_agg
from ppoflow.config.base import _Section

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
