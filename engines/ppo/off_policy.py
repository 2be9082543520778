"""Which off-policy correction an update applies, and under which metric names.

Two gaps separate the policy that sampled a token (the behaviour policy pi_behav) from the trainer's policy
before the update (the proximal policy pi_prox, whose log-probs the trainer recomputes as `old_logprobs`):
  - the kernels: vLLM's sampler and the training forward disagree slightly on the same weights
    (`algo.tis_cap`, truncated importance sampling, Yao et al. 2025);
  - staleness: with pipelined iterations (`pipeline.max_staleness` = k >= 1) iteration i samples with the
    policy committed at i-1-k but trains from the one committed at i-1.
Both are one ratio pi_prox / pi_behav, and one correction covers them: decoupled PPO (Hilton, Cobbe &
Schulman 2022, "Batch size-invariance for policy optimization", eq. 3; the objective AReaL trains its
asynchronous runs with, Fu et al. 2025):

    L_t = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_low, 1 + eps_high)),
    r_t = pi_theta(y_t) / pi_prox(y_t),    w_t = min(pi_prox(y_t) / pi_behav(y_t), C)   (detached)

The clip keeps the update near the proximal policy, so the trust region does not depend on how old the
samples are; w_t re-weights the behaviour policy's samples toward the proximal policy, truncated at C to
bound the variance (losses.truncated_is_weights computes w). With k = 0 and algo.tis_cap unset no weight is
applied and the loss is exactly the on-policy PPO loss.
"""

from __future__ import annotations

from typing import Optional

ASYNC_IS_CAP = 2.0  # C when samples may be stale and algo.tis_cap is unset (veRL's default TIS cap is 2 as well)


def behaviour_is_cap(old_logprobs: str, tis_cap: Optional[float], max_staleness: int) -> Optional[float]:
    """C of the importance weights pi_prox / pi_behav the update applies; None = no weights (on-policy PPO, or
    `old_logprobs` = "rollout", where the old log-probs are pi_behav's own and every weight would be 1).
    Arguments: algo.old_logprobs, algo.tis_cap, pipeline.max_staleness."""
    if old_logprobs == "rollout":
        return None
    if tis_cap is not None:
        return float(tis_cap)
    return ASYNC_IS_CAP if max_staleness >= 1 else None


def is_weight_metric_names(max_staleness: int) -> tuple[str, str]:
    """(mean, clip fraction) metric names of the weights: `async/*` when samples may be stale
    (pipeline.max_staleness >= 1), else `tis/*`."""
    if max_staleness >= 1:
        return "async/is_weight_mean", "async/is_weight_clipfrac"
    return "tis/weight_mean", "tis/clipfrac"
