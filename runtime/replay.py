"""Replay: a fork's iterations N+1..N+M trained on its parent's committed rollout shards instead of sampling again.

    ppoflow fork RUN --at N --name NEW --replay M --set reward...    (flows/fork.py checks and records it)
    ppoflow rescore RUN --iteration K --name NEW --set reward...      (flows/rescore.py: the fork at K-1, replaying K)

Why it is exact at N+1: the fork starts from RUN's checkpoint N, cannot change the seed, the model or the data, and a
replay refuses a changed rollout section (flows/fork.py), so iteration N+1 would sample exactly the rows RUN sampled
there (seeds depend on run.seed, the iteration and the prompt only: stages/rollout.py). The replay skips the
generation and takes those rows by reference. Iterations after N+1 (+ pipeline.max_staleness) were sampled by RUN's
policy, not the fork's: off-policy, so replaying them needs algo.tis_cap (importance weights against the sampler's
log-probs the rows carry).

How each stage of a replayed iteration runs:
- rollout: no task, no engine; `replayed_rollout` answers ppo_iteration (flows/iteration.py) and run_stage
  (runtime/executors.py) with RUN's rollout manifest of that iteration (its content hash, rows, the parent's folder
  as its uri), recorded as the fork's
  `_stages/rollout.json`, with `rollout/replayed: 1` in its metrics. The fork's iteration folder holds no rollout/.
- score: reads RUN's rollout shards in place (the hand-off it is given names them: stages/handed.py) after
  checking their content hash, and computes only the reward sources the fork changed; the unchanged sources'
  scores and the reference log-probs come from RUN's scored rows (stages/rescore.py). Its scored shards are the
  fork's own.
- update, checkpoint, eval: as in any iteration, under the fork's config (its algorithm).

Retention: a replaying fork reads RUN's rollout and scored shards of those iterations while it trains them. Nothing
in ppoflow removes shards (retention removes checkpoints only, and respects the pins of flows/fork.py).
"""

from __future__ import annotations

import time
from typing import Optional

from stages.manifests import RolloutManifest, provenance
from storage import lineage
from storage.layout import layout_for
from storage.stage_records import write_stage_record


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
