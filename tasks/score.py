"""The score stage: reward and reference log-probs for every rollout row, through the prompt-hash cache."""
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
from storage.shards import read_shards, write_shards
from tasks.common import STAGE_BODY_CALLS, as_config, cache_key_fn, layout_for


def scoring_inputs(table: pa.Table) -> list[ScoringInput]:
    cols = table.to_pydict()
    return [ScoringInput(prompt=cols["prompt"][i], response=cols["response"][i], prompt_ids=cols["prompt_ids"][i],
                         response_ids=cols["response_ids"][i], label=cols["label"][i],
                         data_source=cols["data_source"][i],
                         sample_id=f"iter {cols['iteration'][i]} prompt {cols['prompt_index'][i]} "
                                   f"sample {cols['sample_index'][i]}")
            for i in range(table.num_rows)]


def scorer_for(cfg: PPOFlowConfig) -> Scorer:
    """The warm scorer of this process; rebuilt when the scoring settings change."""
    return warm.get_or_build("scorer", cfg.section_hash("model", "reward", "score", "rollout"), lambda: Scorer(cfg))


def run_score(config: PPOFlowConfig | dict, iteration: int, rollout: dict[str, Any]) -> dict[str, Any]:
    """Score the rollout shards of `rollout` (a rollout manifest) -> scored manifest.

    Raises (and commits no scored shard) when a reward source fails; the error names the sample.
    """
    cfg = as_config(config)
    STAGE_BODY_CALLS["score"] += 1
    started = time.perf_counter()
    layout = layout_for(cfg)
    table = read_shards(layout.fs, layout.stage_dir(iteration, "rollout"))
    scorer = scorer_for(cfg)
    cache = ScoreCache(layout.fs, layout.score_cache_dir(scorer.identity), max_bytes=cfg.score.cache_max_bytes) \
        if cfg.score.cache else None
    results, stats = score_with_cache(scorer, scoring_inputs(table), cache)
    scored = (table.append_column("reward", pa.array([r.reward for r in results], pa.float32()))
              .append_column("reward_components", pa.array([json.dumps(r.components) for r in results]))
              .append_column("ref_logprobs", pa.array([r.ref_logprobs for r in results], pa.list_(pa.float32())))
              .append_column("score_cache_hit", pa.array(stats.hit_mask, pa.bool_())))
    stage_dir = layout.stage_dir(iteration, "scored")
    manifest = write_shards(layout.fs, stage_dir, scored, "scored",
                            max_rows=cfg.storage.shard_max_rows, max_bytes=cfg.storage.shard_max_bytes)
    rewards = [r.reward for r in results]
    return {"stage": "score", "iteration": iteration, "uri": layout.url(stage_dir), "rows": manifest.rows,
            "content_hash": manifest.content_hash, "scorer_identity": scorer.identity,
            "cache_hits": stats.hits, "cache_misses": stats.misses, "computed": stats.computed,
            "reward_mean": sum(rewards) / max(len(rewards), 1), "seconds": time.perf_counter() - started}


score_task = task(run_score, name="score", task_run_name="score-iter-{iteration}",
                  cache_key_fn=cache_key_fn("score"), persist_result=True, result_serializer="json")
