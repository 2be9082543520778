"""The trainer at a checkpoint saved without the optimizer state (train.optimizer_state_every = N > 1).

    resumed_trainer(cfg, policy) -> PPOTrainer    what update.take_trainer builds when no warm trainer holds `policy`

Why: AdamW's two moments and the fp32 master weights are three copies of the parameters beside the policy's one,
three quarters of a float32 checkpoint's bytes (2.1 GB a checkpoint for SmolLM2-135M, written and hashed in every
iteration's update stage), yet only a resume reads them. With N > 1 only every N-th checkpoint and the run's last
hold them; the others hold the weights, the RNG state and trainer.json (update count, KL controller, LR schedule,
data cursor).

How a trainer is rebuilt at checkpoint i without them:
1. its base is the newest checkpoint j < i of this run that holds them (retention never removes it:
   storage/checkpoints.apply_retention), else the run's start: the initial model, or a fork's fork point;
2. the updates of iterations j+1..i run again, in order, each on the scored shards its score record names (read and
   hash-checked as the update stage read them: stages/handed.py). An update is a function of the trainer's state and
   those rows (its shuffles are seeded by run.seed and the update count), so this repeats the run's own steps;
3. the replayed weights are written to scratch and hashed as the update stage hashes them. Equal to checkpoint i's
   files, the trainer takes checkpoint i's small state (RNG, data cursor) and goes on exactly as one that never
   stopped;
4. otherwise (a nondeterministic kernel: most GPU backward passes unless torch.use_deterministic_algorithms is on;
   another torch build or thread count; a scored folder gone or rewritten), it logs a warning naming why and builds
   the trainer from checkpoint i's weights and small state with a fresh optimizer state: the weights are still the
   committed ones, AdamW's moments start again (what a weights-only resume does in other trainers). A fork whose
   fork point has no optimizer state starts that way too.

A resume costs up to N-1 updates (no rollout, no scoring) and one save of the weights to scratch. One rank only: the
config refuses N > 1 with train.num_ranks > 1.
"""

from __future__ import annotations

import logging
import os
import time

from engines.trainer.checkpoint import load_trainer_state, save_weights
from engines.trainer.ppo_trainer import PPOTrainer
from stages.handed import HandedShardsError, read_handed
from stages.manifests import PolicyRef, ScoreManifest
from stages.policy import local_checkpoint_dir, policy_ref
from stages.tables import experience_batch
from stages.update_trainer import build_trainer
from storage import lineage
from storage.checkpoints import holds_optimizer_state, newest_with_optimizer_state, read_commit_marker
from storage.layout import layout_for
from storage.run_identity import read_run_record
from storage.scratch import checkpoint_scratch

log = logging.getLogger(__name__)


class _NotReplayable(Exception):
    """Why the updates since the last full checkpoint cannot be run again to checkpoint i's weights."""


def resumed_trainer(cfg, policy: PolicyRef) -> PPOTrainer:
    """A trainer holding `policy` with the optimizer state the run had there (see the module docstring); built from
    the checkpoint alone when it holds that state (or `policy` is the initial model)."""
    iteration = policy.checkpoint_iteration
    if iteration is None:
        return build_trainer(cfg, policy)
    layout = layout_for(cfg)
    marker = read_commit_marker(layout, iteration)
    if marker is None or holds_optimizer_state(marker):  # None: build_trainer's load names the missing checkpoint
        return build_trainer(cfg, policy)
    first = lineage.own_first_iteration(layout)  # 1, or a fork's fork point + 1
    if iteration < first:
        parent = lineage.parent_of(read_run_record(layout)) or {}
        return _fresh_optimizer(cfg, policy, f"it is this fork's fork point, saved by run {parent.get('run')!r}")
    base = newest_with_optimizer_state(layout, range(first, iteration))
    base = first - 1 if base is None else base
    started = time.perf_counter()
    trainer = resumed_trainer(cfg, policy_ref(cfg, base + 1))  # the initial model (0), a fork point or a full one
    try:
        _replay(cfg, trainer, range(base + 1, iteration + 1))
        _check_weights(cfg, trainer, iteration, marker["files"])
    except (_NotReplayable, HandedShardsError, OSError, ValueError) as exc:
        del trainer
        return _fresh_optimizer(cfg, policy, f"replaying iterations {base + 1}-{iteration} failed: {exc}")
    state = local_checkpoint_dir(cfg, policy, parts=("trainer",))
    load_trainer_state(trainer, os.path.join(state, "trainer"), optimizer_state=False)
    log.info(
        "optimizer state at iteration %d rebuilt from %s by replaying %d update(s) in %.1f s",
        iteration,
        f"checkpoint {base}" if base else "the initial model",
        iteration - base,
        time.perf_counter() - started,
    )
    return trainer


def _replay(cfg, trainer: PPOTrainer, iterations: range) -> None:
    """Run the updates of `iterations` again on the scored shards their score records name."""
    layout = layout_for(cfg)
    for iteration in iterations:
        record = lineage.stage_record(layout, iteration, "score")
        if record is None:
            raise _NotReplayable(f"iteration {iteration} has no score record under {layout.iteration_dir(iteration)}")
        scored = ScoreManifest.model_validate(record)
        moved_to = layout.url(layout.stage_dir(iteration, "scored"))
        table = read_handed(cfg.storage, scored, "update replay", iteration, moved_to=moved_to)
        trainer.update(experience_batch(table, trainer.tokenizer.pad_token_id or 0))


def _check_weights(cfg, trainer: PPOTrainer, iteration: int, files: dict) -> None:
    """Raise _NotReplayable unless the replayed weights' files hash as checkpoint `iteration`'s (`files`: its
    marker's {relative path: {"sha256", "bytes"}})."""
    with checkpoint_scratch(layout_for(cfg)) as tmp:
        replayed = save_weights(trainer, tmp)
    differ = sorted(rel for rel, sha in replayed.items() if (files.get(rel) or {}).get("sha256") != sha)
    if differ:
        raise _NotReplayable(f"the replayed weights differ from checkpoint {iteration}'s in {', '.join(differ)}")


def _fresh_optimizer(cfg, policy: PolicyRef, why: str) -> PPOTrainer:
    """The trainer from checkpoint `policy`'s weights and small state, with a fresh optimizer state."""
    log.warning(
        "checkpoint %d holds no optimizer state (train.optimizer_state_every=%d) and %s: training goes on from its "
        "weights with a fresh optimizer state (AdamW's moments start again)",
        policy.checkpoint_iteration,
        cfg.train.optimizer_state_every,
        why,
    )
    return build_trainer(cfg, policy)
