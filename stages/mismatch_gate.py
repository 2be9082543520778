"""The train/inference mismatch gate: the update stage warns or fails when the sampler's log-probs are further
from the trainer's than the config allows (section `mismatch`).

    gate_mismatch(cfg, iteration, policy, rows, metrics) -> metrics

The trainer measures mismatch/* (engines/trainer/mismatch.py: mean and max |log-prob difference| on the policy's
tokens and a k3 estimate of KL(sampler || trainer)) with the weights it starts the update from. That is the
sampler's policy only when the rows were sampled by `policy` itself. Rows sampled by an older behaviour policy
(pipeline.max_staleness >= 1) are measured against their OWN behaviour policy instead (stages/mismatch_behaviour.py:
the trainer's forward of the checkpoint named by their policy_version), so mismatch/* stays a sampler-vs-trainer gap
on the same weights, never staleness; mismatch/off_policy_rows counts those rows, and the gate judges them alike.

Limits: mismatch.max_logprob_diff_mean (None: 1e-3 when the run computes in float32 and the sampler can return the
trainer's log-probs, else none) and
mismatch.max_kl; past one, mismatch.action 'fail' raises MismatchError naming the iteration, the metric, the value
and the limit (nothing of the iteration is committed), 'warn' logs the same words.
"""

from __future__ import annotations

import logging
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from engines.rollout.base import SamplingSettings
from engines.rollout.vllm_logprobs import logprobs_are_exact, logprobs_mode_for
from stages.manifests import PolicyRef
from stages.mismatch_behaviour import behaviour_mismatch

log = logging.getLogger("ppoflow.update")

FLOAT32_LIMIT = 1e-3  # nats per token: ~100x the float32 gaps measured (docs), ~1/10 of a bfloat16 engine's


class MismatchError(RuntimeError):
    """The sampler's log-probs are further from the trainer's than mismatch.* allows; the message names both."""


def default_diff_limit(cfg) -> Optional[float]:
    """mismatch.max_logprob_diff_mean, or its default: FLOAT32_LIMIT for a float32 run whose sampler can return the
    trainer's log-probs, else None (no limit): vLLM cannot with top-p/top-k truncation at a temperature other than 1
    (engines/rollout/vllm_logprobs.py; the engine warns)."""
    if cfg.mismatch.max_logprob_diff_mean is not None:
        return cfg.mismatch.max_logprob_diff_mean
    in_float32 = cfg.model.dtype == "float32" and cfg.model.autocast_dtype is None
    sampling = SamplingSettings.from_config(cfg.rollout)
    exact = cfg.rollout.engine == "hf" or logprobs_are_exact(logprobs_mode_for(sampling), sampling)
    return FLOAT32_LIMIT if in_float32 and exact else None


def gate_mismatch(cfg, iteration: int, policy: PolicyRef, rows: pa.Table, metrics: dict) -> dict:
    """`metrics` with mismatch/* judged (module docstring): a new dict; with off-policy rows, their mismatch/* as
    measured against their behaviour policy. MismatchError past a limit with mismatch.action 'fail'."""
    off_policy = int(pc.sum(pc.not_equal(rows.column("policy_version"), policy.version)).as_py() or 0)
    metrics = dict(metrics)
    if off_policy:
        metrics = {name: value for name, value in metrics.items() if not name.startswith("mismatch/")}
        metrics.update(behaviour_mismatch(cfg, rows), **{"mismatch/off_policy_rows": float(off_policy)})
    sampled_by = sorted(set(rows.column("policy_version").to_pylist())) if off_policy else [policy.version]
    limits = {"mismatch/logprob_abs_diff_mean": default_diff_limit(cfg), "mismatch/kl": cfg.mismatch.max_kl}
    for name, limit in limits.items():
        value = metrics.get(name)
        if limit is None or value is None or value <= limit:
            continue
        message = (
            f"update stage of iteration {iteration}: {name} = {value:.3g} is over the limit {limit:.3g} (config "
            f"mismatch): the sampler's log-probs (policy version {', '.join(map(str, sampled_by))}) are not the "
            f"trainer's for the same weights; look for an engine in another dtype, weights that did not reach it, "
            f"or another kernel"
        )
        if cfg.mismatch.action == "fail":
            raise MismatchError(message)
        log.warning("%s", message)
    return metrics
