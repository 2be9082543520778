"""Replay: a fork's iterations N+1..N+M trained on its parent's committed rollout shards instead of sampling again.

    ppoflow fork RUN --at N --name NEW --replay M --set reward...    (flows/fork.py checks and records it)
    ppoflow rescore RUN --iteration K --name NEW --set reward...      (rescore: the fork at K-1, replaying K, scored)

Why it is exact at N+1: the fork starts from RUN's checkpoint N, cannot change the seed, the model or the data, and a
replay refuses a changed rollout section (flows/fork.py), so iteration N+1 would sample exactly the rows RUN sampled
there (seeds depend on run.seed, the iteration and the prompt only: engines/stages/rollout.py). The replay skips the
generation and takes those rows by reference. Iterations after N+1 (+ pipeline.max_staleness) were sampled by RUN's
policy, not the fork's: off-policy, so replaying them needs algo.tis_cap (importance weights against the sampler's
log-probs the rows carry).

How each stage of a replayed iteration runs:
- rollout: no task, no engine; `replayed_rollout` answers run_stage (flows/stages.py) with RUN's rollout manifest
  of that iteration (its content hash, rows, the parent's folder as its uri), recorded as the fork's
  `_stages/rollout.json`, with `rollout/replayed: 1` in its metrics. The fork's iteration folder holds no rollout/.
- score: reads RUN's rollout shards in place (storage.lineage.rollout_owner) after checking their content hash,
  and computes only the reward sources the fork changed; the unchanged sources' scores and the reference
  log-probs come from RUN's scored rows (engines/stages/rescore.py). Its scored shards are the fork's own.
- update, checkpoint, eval: as in any iteration, under the fork's config (its algorithm).

Retention: a replaying fork reads RUN's rollout and scored shards of those iterations while it trains them. Nothing
in ppoflow removes shards (retention removes checkpoints only, and respects the pins of flows/fork.py).
"""

from __future__ import annotations

import time
from typing import Optional

from engines.stages.manifests import RolloutManifest, ScoreManifest, provenance
from flows.records import write_stage_record
from storage import lineage
from storage.layout import RunLayout, layout_for
from storage.run_identity import read_run_record


def replayed_rollout(cfg, iteration: int) -> Optional[RolloutManifest]:
    """The rollout manifest of a replayed iteration (the parent's, by reference; recorded as this run's), or None
    when `cfg`'s run does not replay `iteration`. FileNotFoundError naming the parent's record when it is gone."""
    layout = layout_for(cfg)
    owner = lineage.rollout_owner(layout, iteration)
    if owner is layout:
        return None
    started = time.perf_counter()
    record = lineage.stage_record(owner, iteration, "rollout")
    if record is None:
        raise FileNotFoundError(
            f"run {layout.run_name!r} replays iteration {iteration} of run {owner.run_name!r}, whose rollout record "
            f"{owner.url(owner.iteration_dir(iteration))}/_stages/rollout.json is gone"
        )
    parent = RolloutManifest.model_validate(record)
    replayed = parent.model_copy(update={**provenance(started), "metrics": {**parent.metrics, "rollout/replayed": 1.0}})
    write_stage_record(layout, iteration, "rollout", replayed.model_dump(mode="json"))
    return replayed


def rescore_fork(root: str, run: str, iteration: int, name: str, overrides=(), storage_cfg=None):
    """`ppoflow rescore RUN --iteration K --name NEW --set reward...`, first half: the fork NEW of RUN at K-1 that
    replays K and stops there (run.iterations=K unless the overrides say otherwise); returns its config. ForkError
    for K < 2 (a fork starts from a committed checkpoint) and as fork_run refuses."""
    from flows.fork import ForkError, fork_run

    if iteration < 2:
        raise ForkError(f"--iteration {iteration}: rescore forks at K-1 from its checkpoint; K must be >= 2")
    return fork_run(root, run, iteration - 1, name, [f"run.iterations={iteration}", *overrides], storage_cfg, replay=1)


def rescore_iteration(cfg, iteration: int) -> ScoreManifest:
    """The second half: the fork's score stage of its replayed `iteration` (a task run, cached by its key), its
    scored shards written under the fork's folder. `ppoflow train` of the fork later trains on them (the score
    stage is then answered from its cache) and goes on."""
    from flows.stages import run_stage_in_process

    return run_stage_in_process(cfg, "score", iteration, rollout=replayed_rollout(cfg, iteration))


def rescore_report(cfg, iteration: int) -> str:
    """Run rescore_iteration; one line: the parent's and the fork's reward/mean, where the shards are, what next."""
    scored = rescore_iteration(cfg, iteration)
    layout = layout_for(cfg)
    parent = lineage.parent_of(read_run_record(layout)) or {}
    parent_layout = RunLayout(parent["root"], parent["run"], layout.storage_cfg)
    before = lineage.stage_record(parent_layout, iteration, "score") or {}
    return (
        f"run {cfg.run.name}: iteration {iteration} of run {parent['run']} rescored, reward/mean "
        f"{before.get('reward_mean', float('nan')):.4f} -> {scored.reward_mean:.4f} ({scored.rows} rows, "
        f"{scored.cache_hits} from the score cache); scored shards: {scored.uri}; train on from them: "
        f"ppoflow train {layout.url(layout.config_path)}"
    )
