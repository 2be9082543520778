"""The update stage: DeepSpeed PPO update of actor (and critic) on the scored shards, staged checkpoint out.

The trainer stays warm in the worker process between iterations. It is taken out of the warm cache for
the update and put back only after its new state is saved: a failure half-way leaves no trainer whose
weights moved past the last checkpoint, so the retry rebuilds from the committed checkpoint and the
result equals a run that never failed.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

import pyarrow as pa
from prefect import task

from engines import warm
from engines.trainer.experience import ExperienceBatch
from engines.trainer.ppo_trainer import PPOTrainer
from ppoflow.config import PPOFlowConfig
from storage.checkpoints import checkpoint_scratch, save_checkpoint_files
from storage.schema import schema_for
from storage.shards import read_shards, write_shards
from tasks.common import STAGE_BODY_CALLS, as_config, cache_key_fn, layout_for, stable_hash
from tasks.policy import local_checkpoint_dir

TRAINER_ROLE = "trainer"
# Test hooks: a fault injected after the PPO step and before the checkpoint is staged (the worst moment),
# and the process killed outright (SIGKILL: no exception handler, finally or atexit runs) once the
# checkpoint's files are written to scratch but before any is staged.
FAULT_ENV = "PPOFLOW_FAULT_UPDATE_ITER"
KILL_ENV = "PPOFLOW_KILL_WHILE_SAVING_ITER"


def _build_trainer(cfg: PPOFlowConfig, policy: dict[str, Any]) -> PPOTrainer:
    ckpt = local_checkpoint_dir(cfg, policy)
    if ckpt is None:
        return PPOTrainer(cfg, policy_dir=policy["uri"], critic_dir=cfg.model.critic_path)
    critic = os.path.join(ckpt, "critic")
    return PPOTrainer(cfg, policy_dir=os.path.join(ckpt, "policy"),
                      critic_dir=critic if os.path.isdir(critic) else None,
                      trainer_state_dir=os.path.join(ckpt, "trainer"))


def take_trainer(cfg: PPOFlowConfig, policy: dict[str, Any]) -> PPOTrainer:
    """The warm trainer if it holds exactly `policy`'s state, else one rebuilt from that checkpoint."""
    trainer = held_trainer(policy["content_hash"])
    warm.invalidate(TRAINER_ROLE)  # a trainer for another checkpoint is dropped before a new one is built
    return trainer if trainer is not None else _build_trainer(cfg, policy)


def held_trainer(content_hash: str) -> Optional[PPOTrainer]:
    """The warm trainer if it holds exactly the checkpoint with this content hash (tasks/policy.py), else None."""
    held = warm.peek(TRAINER_ROLE)
    return held[1] if held is not None and held[0] == content_hash else None


def experience_batch(scored: pa.Table, pad_token_id: int) -> ExperienceBatch:
    """Scored rows -> padded tensors; rows of one prompt (contiguous in the shards) form one group."""
    cols = scored.to_pydict()
    return ExperienceBatch.from_lists(cols["prompt_ids"], cols["response_ids"], cols["reward"], cols["ref_logprobs"],
                                      rollout_logprobs=cols["rollout_logprobs"], group_ids=cols["prompt_index"],
                                      pad_token_id=pad_token_id)


def experience_table(scored: pa.Table, result) -> pa.Table:
    f32 = pa.list_(pa.float32())
    return (scored.append_column("old_logprobs", pa.array(result.old_logprobs, f32))
            .append_column("values", pa.array(result.values, f32))
            .append_column("advantages", pa.array(result.advantages, f32))
            .append_column("returns", pa.array(result.returns, f32))).cast(schema_for("experience"))


def run_update(config: PPOFlowConfig | dict, iteration: int, policy: dict[str, Any],
               scored: dict[str, Any]) -> dict[str, Any]:
    """Train on iteration `iteration`'s scored shards starting from `policy` -> update manifest (staged checkpoint)."""
    cfg = as_config(config)
    STAGE_BODY_CALLS["update"] += 1
    started = time.perf_counter()
    layout = layout_for(cfg)
    table = read_shards(layout.fs, layout.stage_dir(iteration, "scored"))
    trainer = take_trainer(cfg, policy)
    result = trainer.update(experience_batch(table, trainer.tokenizer.pad_token_id or 0))
    if os.environ.get(FAULT_ENV) == str(iteration):
        raise RuntimeError(f"injected fault in the update stage of iteration {iteration} ({FAULT_ENV})")
    exp_dir = layout.stage_dir(iteration, "experience")
    exp_manifest = write_shards(layout.fs, exp_dir, experience_table(table, result), "experience",
                                max_rows=cfg.storage.shard_max_rows, max_bytes=cfg.storage.shard_max_bytes)
    with checkpoint_scratch(layout) as tmp:
        hashed = trainer.save(tmp, extra_state={"iteration": iteration, "data_cursor": {"next_iteration": iteration + 1}})
        if os.environ.get(KILL_ENV) == str(iteration):
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(cfg.to_yaml())
        files = save_checkpoint_files(layout, iteration, tmp, move=True, known_sha256=hashed)
    warm.get_or_build(TRAINER_ROLE, f"staged-{cfg.run.name}-{iteration}", lambda: trainer)
    return {"stage": "update", "iteration": iteration, "checkpoint_uri": layout.url(layout.checkpoint_dir(iteration)),
            "experience_uri": layout.url(exp_dir), "content_hash": stable_hash(files),
            "experience_hash": exp_manifest.content_hash, "metrics": result.metrics,
            "seconds": time.perf_counter() - started}


update_task = task(run_update, name="update", task_run_name="update-iter-{iteration}",
                   cache_key_fn=cache_key_fn("update"), persist_result=True, result_serializer="json")
