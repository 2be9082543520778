"""The score stage: reward and reference log-probs for every rollout row, through the prompt-hash cache.

Failure and retry (the decision for a stage that fails half-way):
- The scored folder of the iteration is UNCOMMITTED (emptied, manifest first) before anything is scored,
  and committed again only by the final `write_shards`. A failed attempt (a reward function raising or
  timing out, a storage error) therefore leaves that folder uncommitted: never a previous attempt's
  output (perhaps of other scoring settings) that could pass for this attempt's, never a mix of both.
- Scores already computed by a previous attempt are not lost with it: they live in the score cache, so a
  retry computes only what it has not computed before (a retry of a completed stage computes nothing).
"""
from __future__ import annotations

import json
import time
from typing import Any

import pyarrow as pa
from prefect import task

from engines import warm
from engines.scoring.cached import score_with_cache
from engines.scoring.scorer import Scorer, ScoringInput
from ppoflow.config import PPOFlowConfig
from storage.score_cache import ScoreCache
from storage.schema import schema_for
from storage.shards import clear_stage_dir, read_shards, write_shards
from tasks.common import STAGE_BODY_CALLS, as_config, cache_key_fn, layout_for, local_path_state


def scoring_inputs(table: pa.Table) -> list[ScoringInput]:
    cols = table.to_pydict()
    return [ScoringInput(prompt=cols["prompt"][i], response=cols["response"][i], prompt_ids=cols["prompt_ids"][i],
                         response_ids=cols["response_ids"][i], label=cols["label"][i],
                         data_source=cols["data_source"][i],
                         sample_id=f"iter {cols['iteration'][i]} prompt {cols['prompt_index'][i]} "
                                   f"sample {cols['sample_index'][i]}")
            for i in range(table.num_rows)]


def scorer_for(cfg: PPOFlowConfig) -> Scorer:
    """The warm scorer of this process; rebuilt when the scoring settings change, and also when the files
    of the reference or of a reward-model folder change in place (new weights under the same path): the
    config alone would keep the old model loaded. A rebuilt scorer has a new identity, so a new cache key
    space: the new weights miss, they never read the old weights' scores.
    """
    folders = [cfg.model.policy_path] + [s.target for s in cfg.reward.sources if s.kind == "model"]
    key = json.dumps([cfg.section_hash("model", "reward", "score", "rollout"), [local_path_state(f) for f in folders]])
    return warm.get_or_build("scorer", key, lambda: Scorer(cfg))


def score_cache_for(cfg: PPOFlowConfig, layout, scorer_identity: str) -> ScoreCache:
    """This process's score cache for the scorer, kept warm between iterations: a new one would read every
    segment in the folder again, the warm one reads only segments other processes wrote since."""
    folder = layout.score_cache_dir(scorer_identity)
    identity = json.dumps([layout.url(folder), cfg.score.cache_max_bytes])
    return warm.get_or_build("score-cache", identity,
                             lambda: ScoreCache(layout.fs, folder, max_bytes=cfg.score.cache_max_bytes))


def run_score(config: PPOFlowConfig | dict, iteration: int, rollout: dict[str, Any]) -> dict[str, Any]:
    """Score the rollout shards of `rollout` (a rollout manifest) -> scored manifest.

    Raises (and commits no scored shard) when a reward source fails; the error names the sample.
    """
    cfg = as_config(config)
    STAGE_BODY_CALLS["score"] += 1
    started = time.perf_counter()
    layout = layout_for(cfg)
    stage_dir = layout.stage_dir(iteration, "scored")
    clear_stage_dir(layout.fs, stage_dir)  # uncommitted until this attempt succeeds: see the module docstring
    table = read_shards(layout.fs, layout.stage_dir(iteration, "rollout"))
    scorer = scorer_for(cfg)
    cache = score_cache_for(cfg, layout, scorer.identity) if cfg.score.cache else None
    results, stats = score_with_cache(scorer, scoring_inputs(table), cache)
    scored = (table.append_column("reward", pa.array([r.reward for r in results], pa.float32()))
              .append_column("reward_components", pa.array([json.dumps(r.components, sort_keys=True) for r in results]))
              .append_column("ref_logprobs", pa.array([r.ref_logprobs for r in results], pa.list_(pa.float32())))
              .append_column("score_cache_hit", pa.array(stats.hit_mask, pa.bool_()))).cast(schema_for("scored"))
    manifest = write_shards(layout.fs, stage_dir, scored, "scored",
                            max_rows=cfg.storage.shard_max_rows, max_bytes=cfg.storage.shard_max_bytes)
    rewards = [r.reward for r in results]
    return {"stage": "score", "iteration": iteration, "uri": layout.url(stage_dir), "rows": manifest.rows,
            "content_hash": manifest.content_hash, "scorer_identity": scorer.identity,
            "cache_hits": stats.hits, "cache_misses": stats.misses, "computed": stats.computed,
            "reward_mean": sum(rewards) / max(len(rewards), 1), "seconds": time.perf_counter() - started}


score_task = task(run_score, name="score", task_run_name="score-iter-{iteration}",
                  cache_key_fn=cache_key_fn("score"), persist_result=True, result_serializer="json")
