"""What the update stage on one rank (update.py) and on a rank group (update_ranks.py) share: building the
trainer from a checkpoint, the staleness of the rows it trains on, and the manifest the stage hands on.

Its own module so that update.py, which sends a multi-rank update to update_ranks.py, and update_ranks.py,
which builds each rank's trainer, both import it and not each other (no import circle).
"""

from __future__ import annotations

import os
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from engines.trainer.ppo_trainer import PPOTrainer
from stages.manifests import PolicyRef, UpdateManifest, provenance
from stages.policy import local_checkpoint_dir
from storage.layout import RunLayout


def build_trainer(cfg, policy: PolicyRef, ckpt: Optional[str] = None) -> PPOTrainer:
    """A trainer holding `policy`: the initial model folders, or the checkpoint's policy/, critic/, trainer/
    (`ckpt`: its local folder when the caller fetched it already, as the ranks of a group are handed it)."""
    ckpt = ckpt or local_checkpoint_dir(cfg, policy)
    if ckpt is None:
        return PPOTrainer(cfg, policy_dir=policy.uri, critic_dir=cfg.model.critic_path)
    critic = os.path.join(ckpt, "critic")
    return PPOTrainer(
        cfg,
        policy_dir=os.path.join(ckpt, "policy"),
        critic_dir=critic if os.path.isdir(critic) else None,
        trainer_state_dir=os.path.join(ckpt, "trainer"),
    )


def staleness(policy: PolicyRef, scored: pa.Table) -> int:
    """How many policy versions the samples are behind the weights they train: policy.version minus the oldest
    `policy_version` of the rows (0 on-policy; min(k, i-1) at iteration i with pipeline.max_staleness = k)."""
    versions = scored.column("policy_version")
    return int(policy.version - pc.min(versions).as_py()) if len(versions) else 0


def update_manifest(
    layout: RunLayout, iteration: int, weights_id: str, experience_hash: str, metrics: dict, started: float
) -> UpdateManifest:
    """The update stage's hand-off (one rank or a group): where iteration `iteration`'s staged checkpoint and
    experience shards are, the staged weights' id, the metrics; `started`: perf_counter at the stage's start."""
    return UpdateManifest(
        iteration=iteration,
        checkpoint_uri=layout.url(layout.checkpoint_dir(iteration)),
        experience_uri=layout.url(layout.stage_dir(iteration, "experience")),
        weights_id=weights_id,
        experience_hash=experience_hash,
        metrics=metrics,
        **provenance(started),
    )
