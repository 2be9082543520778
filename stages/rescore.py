"""Scoring a replayed iteration: rows a parent run scored already, scored again under a fork's scorer, computing
only what changed (runtime/replay.py says when an iteration is replayed).

    replay_scorer(cfg, scorer, owner, parent_cfg, iteration) -> ReplayScorer | None

The parent's scored shards of the iteration hold, row for row, each reward source's raw score
(`reward_components`) and the reference log-probs. A fork's scorer differs from the parent's in some sources (a
new reward function, another reward model, a source removed), in the weights or the clip. For each row:
- the components of sources whose identity (name + what it computes: code, weights) is the parent's are taken
  from the parent's row; only the changed or added sources run, on the replayed rows;
- the reference log-probs are the parent's (a fork cannot change model.policy_path, and a replay refuses a
  changed rollout section, so the reference and the temperature are the parent's: checked below, not assumed);
- the scalar reward is recombined with the fork's weights and clip (Scorer.combine).

The parent's components are trusted only when the parent's recorded scorer identity (its ScoreManifest) equals
the identity of a scorer made of the parent's sources as they are now with the fork's reference: a reward file
edited in place since the parent ran (another identity now) or another reference fails that check, and the
iteration is scored from scratch like any other (replay_scorer returns None). A parent source that the fork
changed or dropped is built once for that check (its identity): a reward model's folder is loaded then.

The ReplayScorer stands in for the Scorer inside score_with_cache (engines/scoring/cached.py): same identity,
inputs read and combine, so its results land in the fork's score-cache key space as a fresh score would, and a
retry of the stage reads them back from the cache. Shapes: reference log-probs (response_len,) per row, float32.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pyarrow as pa
import yaml

from engines.scoring.scorer import Scorer, ScoreResult, ScoringInput, build_reward_sources
from ppoflow.config import PPOFlowConfig, build_config
from stages.handed import read_handed
from stages.manifests import ScoreManifest
from storage import lineage
from storage.layout import RunLayout

_PriorKey = tuple
_PRIOR = ["prompt_ids", "response_ids", "label", "data_source", "reward_components", "ref_logprobs"]  # what is reused


def _prior_key(prompt_ids, response_ids, label, data_source) -> _PriorKey:
    return (tuple(prompt_ids), tuple(response_ids), label, data_source)


class _PriorReference:
    """The parent's reference log-probs of the replayed rows, looked up by tokens (a Scorer's `reference`)."""

    def __init__(self, logprobs: dict[tuple, list[float]], fingerprint: Any):
        self._logprobs, self.fingerprint = logprobs, fingerprint

    def logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """(response_len,) per row; KeyError naming the row's length when the parent did not score it."""
        out = []
        for p, r in zip(prompt_ids, response_ids):
            found = self._logprobs.get((tuple(p), tuple(r)))
            if found is None:
                raise KeyError(f"replayed row ({len(p)} prompt, {len(r)} response tokens) not in the parent's scores")
            out.append(list(found))
        return out


class ReplayScorer:
    """The fork's scorer over replayed rows: the parent's components of unchanged sources and its reference
    log-probs, the changed sources computed (see the module docstring)."""

    def __init__(self, cfg, scorer: Scorer, changed: list, prior: dict[_PriorKey, dict[str, float]], reference: Any):
        self.scorer, self.sources, self.weights, self.clip = scorer, scorer.sources, scorer.weights, scorer.clip
        self.changed_names = [s.name for s in changed]
        self._prior = prior
        # Runs the changed sources only (its own weights unused: the reward is recombined below); its reference
        # answers from the parent's rows, no model forward.
        self._partial = Scorer(cfg, sources=changed, reference=reference)

    @property
    def identity(self) -> str:
        return self.scorer.identity

    @property
    def reward_inputs(self) -> tuple[str, ...]:
        return self.scorer.reward_inputs

    def combine(self, components: dict[str, float]) -> float:
        return self.scorer.combine(components)

    def score(self, inputs: list[ScoringInput]) -> list[ScoreResult]:
        """Score `inputs` (replayed rows): RewardError of a changed source propagates, naming the sample; KeyError
        naming the sample for a row the parent did not score."""
        fresh = self._partial.score(inputs)
        results = []
        for x, r in zip(inputs, fresh):
            prior = self._prior.get(_prior_key(x.prompt_ids, x.response_ids, x.label, x.data_source))
            if prior is None:
                raise KeyError(f"{x.sample_id}: replayed but not among the parent's scored rows")
            components = {s.name: r.components.get(s.name, prior.get(s.name)) for s in self.sources}
            results.append(
                ScoreResult(reward=self.combine(components), components=components, ref_logprobs=r.ref_logprobs)
            )
        return results


class _Named:
    """A reward source as Scorer.identity sees it: a name and an identity."""

    def __init__(self, name: str, identity: str):
        self.name, self.identity = name, identity


def _parent_sources(cfg, scorer: Scorer, parent_cfg) -> list[_Named]:
    """The parent's sources as they are now: the fork's own source where the spec is the same, else the parent's
    spec built once (a reward model is loaded) for its identity."""
    mine = {(spec.name or spec.kind): (spec, source) for spec, source in zip(cfg.reward.sources, scorer.sources)}
    out = []
    for spec in parent_cfg.reward.sources:
        name = spec.name or spec.kind
        if name in mine and mine[name][0] == spec:
            out.append(_Named(name, mine[name][1].identity))
            continue
        one = parent_cfg.model_copy(update={"reward": parent_cfg.reward.model_copy(update={"sources": [spec]})})
        (source,) = build_reward_sources(one)
        out.append(_Named(name, source.identity))
        getattr(source, "close", lambda: None)()
    return out


def replay_scorer(cfg, scorer: Scorer, owner: RunLayout, parent_cfg, iteration: int) -> Optional[ReplayScorer]:
    """A ReplayScorer over `owner`'s (the parent's) scored rows of `iteration`, or None when they cannot be trusted
    or are absent (then the caller scores from scratch). See the module docstring. HandedShardsError
    (stages/handed.py) when the parent's scored folder holds other shards than its score record names."""
    record = lineage.stage_record(owner, iteration, "score")
    if record is None:
        return None
    parent_sources = _parent_sources(cfg, scorer, parent_cfg)
    # The parent's sources, weights, clip and temperature with the fork's reference: the parent's identity only if
    # those sources still compute what they did and the reference is the one the parent scored with.
    probe = Scorer(parent_cfg, sources=parent_sources, reference=scorer.reference)
    if record.get("scorer_identity") != probe.identity:
        return None
    known = {(s.name, s.identity) for s in parent_sources}
    changed = [s for s in scorer.sources if (s.name, s.identity) not in known]
    # the parent's scored shards as its score record names them (its uri, checked against its content hash)
    scored = read_handed(
        owner.storage_cfg,
        ScoreManifest.model_validate(record),
        "replay score",
        iteration,
        _PRIOR,
        moved_to=owner.url(owner.stage_dir(iteration, "scored")),
    )
    prior, logprobs = _prior_rows(scored)
    reference = _PriorReference(logprobs, getattr(scorer.reference, "fingerprint", None))
    return ReplayScorer(cfg, scorer, changed, prior, reference)


def run_config(layout: RunLayout) -> PPOFlowConfig:
    """The config a run saved (its config.yaml): what its scored shards were scored with."""
    return build_config(yaml.safe_load(layout.fs.cat_file(layout.config_path).decode()), layout.url(layout.config_path))


def _prior_rows(table: pa.Table) -> tuple[dict[_PriorKey, dict[str, float]], dict[tuple, list[float]]]:
    """The parent's components by (tokens, label, data_source) and reference log-probs by tokens."""
    cols = table.select(_PRIOR)
    d = cols.to_pydict()
    prior, logprobs = {}, {}
    for p, r, label, source, components, ref in zip(*(d[c] for c in cols.column_names)):
        prior.setdefault(_prior_key(p, r, label, source), json.loads(components))
        logprobs.setdefault((tuple(p), tuple(r)), ref)
    return prior, logprobs
