"""Scoring through a content-addressed cache: never compute the same (scorer, prompt, response) twice.

Key = sha256(scorer identity, prompt token ids, response token ids, and the reward inputs beyond the
tokens that the scorer's sources read: the label / ground truth and the data_source). The scorer identity
covers the reference and reward-model weights, the reward sources' names/versions/weights and the scoring
settings, so a changed scorer is a new key space: a miss, never a stale hit. The label is in the key
because a function reward reads it: two datasets with the same prompt and different labels must not share
a score. A scorer whose sources read only tokens (reward models) keeps label-free keys, so its hits are
shared across datasets; a scorer that does not say what it reads (`reward_inputs`) gets both in its keys.

Per call:
1. keys for all rows; 2. one batched cache lookup; 3. the missing keys are de-duplicated (GRPO's repeated
answers, repeated prompts) and scored once each; 4. the new entries are written back in one batch.

The cache is any object with `get_many(keys) -> {key: entry}` and `put_many({key: entry})` (storage's
ScoreCache implements it); None scores everything. An entry holds what cannot be recomputed cheaply:
`reward_components` (source name -> raw score) and `ref_logprobs`. The scalar reward is NOT trusted from
the cache: it is recombined from the components with the scorer's weights and clip (`combined_reward`),
so a hit returns exactly what a fresh computation returns (ScoreCache stores log-probs as float32, which
is what the reference returns too, so they round-trip exactly).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence


class ScoreCacheLike(Protocol):
    def get_many(self, keys: list[str]) -> dict[str, dict[str, Any]]: ...
    def put_many(self, entries: dict[str, dict[str, Any]]) -> None: ...


@dataclass
class CacheStats:
    hits: int = 0  # rows answered from the cache
    misses: int = 0  # rows not in the cache
    computed: int = 0  # distinct (prompt, response) pairs actually scored (<= misses)
    hit_mask: list[bool] = field(default_factory=list)  # (B,) True where the row came from the cache


# What a scorer's rewards may depend on besides the tokens, when it does not say (see score_inputs_read).
ALL_REWARD_INPUTS = ("label", "data_source")
# What a scorer may declare: the above, and a multi-turn row's env_reward (read by reward kind "environment"; in
# the key because an environment's reward need not follow from the tokens alone). Never assumed undeclared, so
# the keys of scorers that do not read it are what they were.
KNOWN_REWARD_INPUTS = ALL_REWARD_INPUTS + ("env_reward",)


def score_key(
    scorer_identity: str, prompt_ids: Sequence[int], response_ids: Sequence[int], extra: Optional[dict[str, Any]] = None
) -> str:
    """sha256 hex of the scorer identity, the token ids and `extra` ({"label": ..., "data_source": ...},
    only the inputs the scorer reads; None or {} gives the key of tokens alone)."""
    h = hashlib.sha256()
    h.update(scorer_identity.encode())
    h.update(b"|p:" + ",".join(map(str, prompt_ids)).encode())
    h.update(b"|r:" + ",".join(map(str, response_ids)).encode())
    if extra:
        h.update(b"|x:" + json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def score_inputs_read(scorer) -> tuple[str, ...]:
    """The reward inputs beyond the tokens that `scorer`'s keys must hold: its `reward_inputs` when it
    declares them (Scorer: the union over its sources), else all of ALL_REWARD_INPUTS."""
    declared = getattr(scorer, "reward_inputs", None)
    return ALL_REWARD_INPUTS if declared is None else tuple(x for x in KNOWN_REWARD_INPUTS if x in declared)


def _key_of(scorer_identity: str, reads: tuple[str, ...], x) -> str:
    return score_key(scorer_identity, x.prompt_ids, x.response_ids, {name: getattr(x, name) for name in reads})


def _entry(result) -> dict[str, Any]:
    return {"reward_components": dict(result.components), "ref_logprobs": [float(x) for x in result.ref_logprobs]}


def combined_reward(scorer, components: dict[str, float]) -> float:
    """clip(sum_k weight_k * components[name_k], -clip, clip): the scorer's own formula, term by term in
    source order, so the float is bit-identical to Scorer.score's. Uses `scorer.combine` when it has one.

    Raises KeyError naming the source when `components` lacks one (an entry of another scorer).
    """
    combine = getattr(scorer, "combine", None)
    if combine is not None:
        return combine(components)
    missing = [s.name for s in scorer.sources if s.name not in components]
    if missing:
        raise KeyError(f"score cache entry has no component for reward sources {missing}")
    total = sum(w * components[s.name] for w, s in zip(scorer.weights, scorer.sources))
    return max(-scorer.clip, min(scorer.clip, total))


def score_with_cache(scorer, inputs: list, cache: Optional[ScoreCacheLike]) -> tuple[list, CacheStats]:
    """Score `inputs` (list of ScoringInput) with `scorer`, consulting `cache`. Returns (results, stats).

    results[i] is the ScoreResult of inputs[i]: from the cache (stats.hit_mask[i]) or from ONE call
    `scorer.score(distinct missing pairs, in first-seen order)`, so a warm call returns bit for bit what
    the cold call returned. Errors of the scorer propagate unchanged (they name the sample); nothing is
    written to the cache for a failed batch.
    """
    from engines.scoring.scorer import ScoreResult

    identity, reads = scorer.identity, score_inputs_read(scorer)
    keys = [_key_of(identity, reads, x) for x in inputs]
    found = cache.get_many(sorted(set(keys))) if cache is not None else {}
    todo: dict[str, int] = {}  # key -> index of the first row that needs it
    for i, k in enumerate(keys):
        if k not in found and k not in todo:
            todo[k] = i
    fresh: dict[str, Any] = {}  # key -> ScoreResult computed now
    if todo:
        results = scorer.score([inputs[i] for i in todo.values()])
        fresh = dict(zip(todo.keys(), results))
        if cache is not None:
            cache.put_many({k: _entry(r) for k, r in fresh.items()})
    stats = CacheStats(computed=len(todo))
    out = []
    for k in keys:
        hit = k in found
        stats.hit_mask.append(hit)
        if hit:
            entry = found[k]
            components = dict(entry["reward_components"])
            out.append(
                ScoreResult(
                    reward=combined_reward(scorer, components),
                    components=components,
                    ref_logprobs=list(entry["ref_logprobs"]),
                )
            )
        else:
            r = fresh[k]  # copies: rows sharing a pair must not share mutable lists
            out.append(ScoreResult(reward=r.reward, components=dict(r.components), ref_logprobs=list(r.ref_logprobs)))
    stats.hits = sum(stats.hit_mask)
    stats.misses = len(keys) - stats.hits
    return out, stats
