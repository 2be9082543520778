"""The score stage: reward and reference log-probs for every rollout row, through the prompt-hash cache.

    score_rows(scorer, rollout rows, cache) -> (scored rows, CacheStats)   (the compute, shared with the loop)
    run_score(cfg, iteration, rollout) -> ScoreManifest                   (the stage)

Failure and retry (the decision for a stage that fails half-way):
- The scored folder of the iteration is UNCOMMITTED (emptied, manifest first) before anything is scored,
  and committed again only by the final `write_shards`. A failed attempt (a reward function raising or
  timing out, a storage error) therefore leaves that folder uncommitted: never a previous attempt's
  output (perhaps of other scoring settings) that could pass for this attempt's, never a mix of both.
- Scores already computed by a previous attempt are not lost with it: they live in the score cache, so a
  retry computes only what it has not computed before (a retry of a completed stage computes nothing).

What it reads: the rollout shards at the handed manifest's uri, refused (stages/handed.py) unless they have its
content hash; a refusal happens before anything is written. A fork that replays this iteration (runtime/replay.py) is
handed its parent's rollout manifest, so it reads the parent's folder in place, and scores the rows through a
ReplayScorer (stages/rescore.py): only the reward sources the fork changed run.
"""

from __future__ import annotations

import time
from typing import Optional

import pyarrow as pa

from engines import warm
from engines.scoring.cached import CacheStats, ScoreCacheLike, score_with_cache
from engines.scoring.scorer import Scorer
from stages.handed import read_handed
from stages.held import score_cache_for, scorer_for
from stages.manifests import RolloutManifest, ScoreManifest, provenance
from stages.rescore import replay_scorer, run_config
from stages.tables import scored_table, scoring_inputs, write_stage_table
from storage.layout import layout_for
from storage.lineage import rollout_owner
from storage.shards import clear_stage_dir


def score_rows(scorer: Scorer, rollout: pa.Table, cache: Optional[ScoreCacheLike]) -> tuple[pa.Table, CacheStats]:
    """Scored rows for the rollout rows (cache None = compute every distinct pair). A reward source's error
    propagates unchanged and names the sample."""
    results, stats = score_with_cache(scorer, scoring_inputs(rollout), cache)
    return scored_table(rollout, results, stats.hit_mask), stats


def run_score(cfg, iteration: int, rollout: RolloutManifest) -> ScoreManifest:
    """Score the rollout shards `rollout` names and write the iteration's scored shards (see the module docstring on
    failure). HandedShardsError (stages/handed.py) when the shards at rollout.uri are not the ones it names."""
    started = time.perf_counter()
    layout = layout_for(cfg)
    table = read_handed(
        cfg.storage, rollout, "score", iteration, moved_to=layout.url(layout.stage_dir(iteration, "rollout"))
    )
    stage_dir = layout.stage_dir(iteration, "scored")
    clear_stage_dir(layout.fs, stage_dir)  # uncommitted until this attempt succeeds: see the module docstring
    owner = rollout_owner(layout, iteration)  # the parent, for a fork that replays this iteration
    with warm.stage_lock("score"):  # pipelined iterations: one scorer, one score at a time
        scorer = scorer_for(cfg)
        if owner is not layout:
            scorer = replay_scorer(cfg, scorer, owner, run_config(owner), iteration) or scorer
        cache = score_cache_for(cfg, layout, scorer.identity) if cfg.score.cache else None
        scored, stats = score_rows(scorer, table, cache)
    manifest = write_stage_table(cfg, layout, iteration, "scored", scored)
    rewards = scored.column("reward").to_pylist()
    return ScoreManifest(
        iteration=iteration,
        uri=layout.url(stage_dir),
        rows=manifest.rows,
        content_hash=manifest.content_hash,
        scorer_identity=scorer.identity,
        cache_hits=stats.hits,
        cache_misses=stats.misses,
        computed=stats.computed,
        reward_mean=sum(rewards) / max(len(rewards), 1),
        **provenance(started),
    )
