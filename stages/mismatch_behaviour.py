"""The mismatch of rows sampled by an older policy, measured against that policy (its behaviour policy).

    behaviour_mismatch(cfg, rows) -> {"mismatch/logprob_abs_diff_mean", "..._max", "mismatch/kl", "mismatch/tokens"}

Why: with pipeline.max_staleness = k >= 1, iteration i's rows were sampled by the policy committed at i-1-k, while
the trainer starts from the one committed at i-1. The trainer's log-probs are then of another policy: their gap to
the sampler's is staleness plus mismatch, not mismatch. The sampler-vs-trainer gap asks "do the two kernels agree
on the SAME weights", so the trainer's side must be of the policy that sampled the row. The rows carry only the
sampler's log-probs of it (rollout_logprobs), so the trainer's side is computed here: the behaviour checkpoint
(`policy_version` of the rows; 0 = the initial model), loaded frozen in the trainer's dtype and scored by the
trainer's own forward (engines/trainer/forward.policy_forward through engines/scoring/reference.ReferenceModel)
at the sampling temperature, over each row's policy tokens (token_owner 1; every response token single-turn).

Cost: one forward over the iteration's rows per behaviour version (one, under the fixed staleness schedule) plus
loading that checkpoint's policy/ (fetched and verified against its commit marker, as a rollout loads it), in the
update stage's process; the checkpoint is there: retention keeps k + 1 of them (stages/checkpoint.py). On-policy
iterations (every row of the trainer's starting version) never call this: the trainer measures them for free.
Failure modes: RuntimeError naming the version when its checkpoint is not committed; a checkpoint whose files differ
from its marker fails as a rollout's load does (CheckpointCorruptError naming the file).
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc
import torch

from engines.ppo.mismatch import MismatchSums, mismatch_metrics, mismatch_sums
from engines.scoring.scorer import build_reference
from stages.policy import local_policy_dir, policy_ref

log = logging.getLogger("ppoflow.update")


def behaviour_mismatch(cfg, rows: pa.Table) -> dict[str, float]:
    """mismatch/* of `rows` (rollout columns: prompt_ids, response_ids, rollout_logprobs, policy_version, and
    token_owner when multi-turn), each row against the trainer's log-probs of the policy that sampled it;
    {} without rows or policy tokens."""
    total = MismatchSums(0.0, 0.0, 0.0, 0.0)
    versions = pc.unique(rows.column("policy_version")).to_pylist() if rows.num_rows else []
    for version in sorted(versions):
        sampled = rows.filter(pc.equal(rows.column("policy_version"), version))
        total = _added(total, _version_sums(cfg, int(version), sampled))
    return mismatch_metrics(total)


def _version_sums(cfg, version: int, rows: pa.Table) -> MismatchSums:
    """The MismatchSums of `rows`, all sampled by policy `version`, against the trainer's forward of that policy."""
    try:
        behaviour = policy_ref(cfg, version + 1)  # iteration version + 1 starts from the policy committed at `version`
    except RuntimeError as exc:
        raise RuntimeError(
            f"mismatch gate: {rows.num_rows} rows were sampled by policy version {version}, whose checkpoint is "
            f"needed to measure them against it: {exc}"
        ) from exc
    model = build_reference(cfg, local_policy_dir(cfg, behaviour))  # the trainer's forward on that checkpoint
    trainer = model.logprobs(rows.column("prompt_ids").to_pylist(), rows.column("response_ids").to_pylist())
    sampler = rows.column("rollout_logprobs").to_pylist()
    owners = rows.column("token_owner").to_pylist() if "token_owner" in rows.column_names else [None] * len(sampler)
    total = MismatchSums(0.0, 0.0, 0.0, 0.0)
    for sampled, computed, owner in zip(sampler, trainer, owners):
        mask = torch.ones(len(sampled)) if owner is None else torch.tensor(owner, dtype=torch.float32)
        row = mismatch_sums(torch.tensor([sampled]), torch.tensor([computed]), mask[None])
        total = _added(total, row)
    log.info("mismatch of %d rows sampled by policy version %d measured against it (%s)", rows.num_rows, version,
             behaviour.weights_id)  # fmt: skip
    return total


def _added(a: MismatchSums, b: MismatchSums) -> MismatchSums:
    return MismatchSums(a.abs_sum + b.abs_sum, a.kl_sum + b.kl_sum, max(a.abs_max, b.abs_max), a.tokens + b.tokens)
