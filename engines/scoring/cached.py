"""Scoring through a content-addressed cache: never compute the same (scorer, prompt, response) twice.

Key = sha256(scorer identity, prompt token ids, response token ids). The scorer identity covers the
reference and reward-model weights, the reward sources' names/versions/weights and the scoring settings,
so a changed scorer is a new key space: a miss, never a stale hit.

Per call:
1. keys for all rows; 2. one batched cache lookup; 3. the missing keys are de-duplicated (GRPO's repeated
answers, repeated prompts) and scored once each; 4. the new entries are written back in one batch.

The cache is any object with `get_many(keys) -> {key: entry}` and `put_many({key: entry})` (storage's
ScoreCache implements it); None scores everything.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence


class ScoreCacheLike(Protocol):
    def get_many(self, keys: list[str]) -> dict[str, dict[str, Any]]: ...
    def put_many(self, entries: dict[str, dict[str, Any]]) -> None: ...


@dataclass
class CacheStats:
    hits: int = 0            # rows answered from the cache
    misses: int = 0          # rows not in the cache
    computed: int = 0        # distinct (prompt, response) pairs actually scored (<= misses)
    hit_mask: list[bool] = field(default_factory=list)  # (B,) True where the row came from the cache


def score_key(scorer_identity: str, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> str:
    h = hashlib.sha256()
    h.update(scorer_identity.encode())
    h.update(b"|p:" + ",".join(map(str, prompt_ids)).encode())
    h.update(b"|r:" + ",".join(map(str, response_ids)).encode())
    return h.hexdigest()


def _entry(result) -> dict[str, Any]:
    return {"reward": float(result.reward), "reward_components": dict(result.components),
            "ref_logprobs": [float(x) for x in result.ref_logprobs]}


def score_with_cache(scorer, inputs: list, cache: Optional[ScoreCacheLike]) -> tuple[list, CacheStats]:
    """Score `inputs` (list of ScoringInput) with `scorer`, consulting `cache`. Returns (results, stats).

    results[i] is a ScoreResult equal to what scorer.score([inputs[i]]) returns. Errors of the scorer
    propagate unchanged (they name the sample); nothing is written to the cache for a failed batch.
    """
    from engines.scoring.scorer import ScoreResult

    keys = [score_key(scorer.identity, x.prompt_ids, x.response_ids) for x in inputs]
    found = cache.get_many(sorted(set(keys))) if cache is not None else {}
    todo: dict[str, int] = {}  # key -> index of the first row that needs it
    for i, k in enumerate(keys):
        if k not in found and k not in todo:
            todo[k] = i
    fresh: dict[str, dict[str, Any]] = {}
    if todo:
        results = scorer.score([inputs[i] for i in todo.values()])
        fresh = {k: _entry(r) for k, r in zip(todo.keys(), results)}
        if cache is not None:
            cache.put_many(fresh)
    stats = CacheStats(computed=len(todo))
    out = []
    for k in keys:
        hit = k in found
        entry = found[k] if hit else fresh[k]
        stats.hit_mask.append(hit)
        out.append(ScoreResult(reward=entry["reward"], components=entry["reward_components"],
                               ref_logprobs=entry["ref_logprobs"]))
    stats.hits = sum(stats.hit_mask)
    stats.misses = len(keys) - stats.hits
    return out, stats
