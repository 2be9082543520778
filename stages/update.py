"""The update stage: the PPO update of actor (and critic) on the scored shards, a staged checkpoint out.

    train_on(trainer, scored rows) -> UpdateResult                 (the compute, shared with the loop)
    run_update(cfg, iteration, policy, scored) -> UpdateManifest         (the stage)
    build_trainer, staleness, update_manifest: shared with the rank group's update (update_trainer.py)
    resumed_trainer: the trainer rebuilt at a checkpoint without optimizer state (update_replay.py)

The trainer stays warm in the worker process between iterations. It is TAKEN from the warm registry for
the policy the iteration starts from and PUT back, under the identity of the checkpoint it staged, only
after that checkpoint's files are saved: a failure half-way leaves no trainer whose weights moved past the
last checkpoint, so the retry rebuilds from the committed checkpoint and equals a run that never failed.
"""

from __future__ import annotations

import os
import time

import pyarrow as pa

from engines import warm
from engines.trainer import torchrun_group
from engines.trainer.ppo_trainer import PPOTrainer, UpdateResult
from stages.curriculum_state import next_state, stage_state
from stages.handed import read_handed
from stages.held import trainer_key
from stages.manifests import PolicyRef, ScoreManifest, UpdateManifest
from stages.mismatch_gate import gate_mismatch
from stages.policy import checkpoint_weights_id
from stages.tables import experience_batch, experience_table, write_stage_table
from stages.update_replay import resumed_trainer
from stages.update_trainer import staleness, update_manifest
from storage.checkpoints import save_checkpoint_files
from storage.layout import layout_for
from storage.scratch import checkpoint_scratch


def train_on(trainer: PPOTrainer, scored: pa.Table) -> UpdateResult:
    """One PPO update on the scored rows (the trainer's weights and optimizer state move); the result holds
    the metrics and the per-token old log-probs, values, advantages and returns of every row."""
    return trainer.update(experience_batch(scored, trainer.tokenizer.pad_token_id or 0))


def optimizer_state_due(cfg, iteration: int) -> bool:
    """Whether iteration `iteration`'s checkpoint holds the optimizer state: every train.optimizer_state_every-th
    and the run's last (a finished run, or a fork of its end, resumes without replaying: update_replay.py)."""
    return iteration % cfg.train.optimizer_state_every == 0 or iteration >= cfg.run.iterations


_TRAINER_SECTIONS = ("model", "algo", "train", "reward")  # tasks/cache_keys.py: what the update depends on


def take_trainer(cfg, policy: PolicyRef) -> PPOTrainer:
    """The warm trainer if it holds exactly `policy`'s weights and was built for the same update settings, else
    one rebuilt from that checkpoint, its optimizer state replayed when the checkpoint has none (update_replay.py; a
    warm trainer for other weights is dropped first: two trainers never hold memory at once). Same weights under
    other settings: a fork (flows/fork.py) trained in the process that committed its fork point, e.g. with another
    algo.kl_coef or train.actor_lr."""
    trainer = warm.take(trainer_key(policy.weights_id))
    if trainer is not None and trainer.cfg.section_hash(*_TRAINER_SECTIONS) != cfg.section_hash(*_TRAINER_SECTIONS):
        trainer = None  # dropped: rebuilt below from the committed checkpoint under this run's settings
    if trainer is None:
        trainer = resumed_trainer(cfg, policy)
        warm.count_build(warm.Role.TRAINER.value)
    return trainer


def run_update(cfg, iteration: int, policy: PolicyRef, scored: ScoreManifest) -> UpdateManifest:
    """Train on the scored shards `scored` names starting from `policy`; stage the new checkpoint.

    The shards are read at scored.uri, refused (HandedShardsError, stages/handed.py) unless they have its content hash.
    With train.num_ranks > 1, or on a worker that torchrun started as a group, the update runs on that torchrun group
    (update_ranks.py; ConfigError there when this process is not rank 0 of one).
    """
    if cfg.train.num_ranks > 1 or torchrun_group.current() is not None:
        from stages.update_ranks import run_update_on_ranks

        return run_update_on_ranks(cfg, iteration, policy, scored)
    started = time.perf_counter()
    layout = layout_for(cfg)
    table = read_handed(
        cfg.storage, scored, "update", iteration, moved_to=layout.url(layout.stage_dir(iteration, "scored"))
    )
    trainer = take_trainer(cfg, policy)
    training = time.perf_counter()
    result = train_on(trainer, table)
    trained = time.perf_counter()
    result.metrics = gate_mismatch(cfg, iteration, policy, table, result.metrics)  # before anything is staged
    curriculum, curriculum_metrics = next_state(cfg, policy, table)  # data.reasoning_gym.curriculum: the next level
    exp_manifest = write_stage_table(cfg, layout, iteration, "experience", experience_table(table, result))
    saving = time.perf_counter()
    with checkpoint_scratch(layout) as tmp:
        hashed = trainer.save(
            tmp,
            extra_state={"iteration": iteration, "data_cursor": {"next_iteration": iteration + 1}},
            optimizer_state=optimizer_state_due(cfg, iteration),
        )
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(cfg.to_yaml())
        stage_state(tmp, curriculum)
        staged = save_checkpoint_files(layout, iteration, tmp, move=True, known_sha256=hashed)
    saved = time.perf_counter()
    weights_id = checkpoint_weights_id(staged["files"])
    warm.put(trainer_key(weights_id), trainer)
    metrics = {**result.metrics, **curriculum_metrics, "async/staleness": staleness(policy, table)}
    # where the stage's seconds go (bench.roofline): the PPO update itself, and the checkpoint written and hashed
    metrics["timing/update_train"], metrics["timing/update_save"] = trained - training, saved - saving
    return update_manifest(layout, iteration, weights_id, exp_manifest.content_hash, metrics, started)
