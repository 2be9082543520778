"""The curriculum level of each iteration, kept in the committed checkpoints (data.reasoning_gym.curriculum).

    state_at(cfg, policy) -> CurriculumState | None     the state a policy's checkpoint committed (None: no curriculum)
    iteration_level(cfg, policy) -> int | None          the level a rollout with `policy` samples at
    tag_level(table, level) -> table                    rollout rows + curriculum_level (storage/schema.py)
    next_state(cfg, policy, scored) -> (state, metrics) the state after this iteration's update (engines/curriculum.py)
    stage_state(folder, state)                          writes curriculum.json into the staged checkpoint

Where the level lives: each checkpoint holds `curriculum.json` ({level, streak}: the level the NEXT iteration
trains at), beside policy/ and trainer/, listed with its sha256 in the commit marker like every checkpoint file. So
the level is part of what a commit makes durable: a run killed at any point resumes from LATEST at the level that
checkpoint committed, and a fork at iteration j starts at the level of j. The initial policy (no checkpoint) is
start_level. A checkpoint without the file (written by a run without a curriculum) also reads as start_level.

Which checkpoint: the rollout of iteration i samples at the level of the checkpoint its behaviour policy comes from
(i-1, or i-1-k with pipeline.max_staleness = k): fixed by the schedule, so a retry or a resume draws the same rows.
The update of iteration i starts from checkpoint i-1's state and measures the reward of the rows at that state's
level; rows at another level (a stale rollout sampled before a promotion) measure nothing and keep the streak.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from engines.curriculum import CurriculumState, advance
from stages.manifests import PolicyRef
from storage import fs as fsutil
from storage.checkpoints import checkpoint_owner, read_commit_marker
from storage.layout import layout_for
from storage.schema import CURRICULUM_COLUMN

STATE_FILE = "curriculum.json"
log = logging.getLogger("ppoflow.curriculum")


def _plan(cfg):
    spec = cfg.data.reasoning_gym
    return None if spec is None else spec.curriculum


def state_at(cfg, policy: PolicyRef) -> Optional[CurriculumState]:
    """The curriculum state `policy`'s checkpoint committed; start_level for the initial policy or a checkpoint
    without the file; None without a curriculum. ValueError naming the file when it is damaged (its sha256 is not
    the commit marker's, or it is not a state)."""
    plan = _plan(cfg)
    if plan is None:
        return None
    start = CurriculumState(plan.start_level, 0)
    if policy.checkpoint_iteration is None:
        return start
    layout = layout_for(cfg)
    iteration = policy.checkpoint_iteration
    marker = read_commit_marker(layout, iteration) or {}
    listed = marker.get("files", {}).get(STATE_FILE)
    if listed is None:
        return start
    owner = checkpoint_owner(layout, iteration)
    path = fsutil.join(owner.checkpoint_dir(iteration), STATE_FILE)
    data = fsutil.read_bytes(owner.fs, path)
    where = fsutil.url_of(owner.fs, path)
    if hashlib.sha256(data).hexdigest() != listed.get("sha256"):
        raise ValueError(f"{where}: its sha256 is not the one its commit marker lists (changed after the commit)")
    try:
        return CurriculumState.from_json(json.loads(data), where)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None


def iteration_level(cfg, policy: PolicyRef) -> Optional[int]:
    """The level a rollout with behaviour policy `policy` samples at; None without a curriculum."""
    state = state_at(cfg, policy)
    return None if state is None else state.level


def tag_level(table: pa.Table, level: Optional[int]) -> pa.Table:
    """Rollout rows with the curriculum_level column (every row `level`); the table itself when level is None."""
    if level is None:
        return table
    return table.append_column(CURRICULUM_COLUMN, pa.array([level] * table.num_rows, pa.int32()))


def next_state(cfg, policy: PolicyRef, scored: pa.Table) -> tuple[Optional[CurriculumState], dict[str, float]]:
    """The state to commit with this update (module docstring) and its metrics: curriculum/level (the level of the
    rows trained on), curriculum/reward_at_level (their reward mean at the state's level, when any row is at it),
    curriculum/next_level. (None, {}) without a curriculum."""
    state = state_at(cfg, policy)
    if state is None:
        return None, {}
    levels = scored.column(CURRICULUM_COLUMN)
    at_level = scored.filter(pc.equal(levels, state.level))
    reward = pc.mean(at_level.column("reward")).as_py() if at_level.num_rows else None
    after, promoted = advance(_plan(cfg), state, reward)
    if promoted:  # said in the run's log; the level is also the metric curriculum/next_level
        log.info(
            "curriculum: level %d -> %d after %d iteration(s) with reward >= %s at level %d (last %.3f)",
            state.level,
            after.level,
            _plan(cfg).promote_after,
            _plan(cfg).promote_at,
            state.level,
            reward,
        )
    metrics = {"curriculum/level": float(pc.max(levels).as_py()), "curriculum/next_level": float(after.level)}
    if reward is not None:
        metrics["curriculum/reward_at_level"] = float(reward)
    return after, metrics


def stage_state(folder: str, state: Optional[CurriculumState]) -> None:
    """Write `state` as curriculum.json into the staged checkpoint folder (nothing when None)."""
    if state is not None:
        with open(os.path.join(folder, STATE_FILE), "w") as f:
            json.dump(state.to_json(), f, sort_keys=True)
