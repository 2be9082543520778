"""The scorer: the configured reward sources plus reference log-probs, for a list of samples.

reward = clip(sum_k weight_k * score_k, -reward.clip, +reward.clip); `components` keeps each source's raw
(unweighted) score under its name. Reference log-probs are taken at the sampling temperature.

This is the plain, un-cached scorer (each source batches by its own `batch_size`; the reference by its
micro-batch). The prompt-hash cache wraps it (engines/scoring/cached.py), keyed by `Scorer.identity`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from engines.rewards.base import RewardBatch, RewardError, RewardSource
from engines.scoring.batching import token_budget_batches


@dataclass
class ScoringInput:
    """One sample to score; `sample_id` is how errors name it (e.g. "iter 3 prompt 12 sample 1")."""

    prompt: str
    response: str
    prompt_ids: list[int]
    response_ids: list[int]
    label: Any = None
    data_source: Optional[str] = None
    env_reward: Optional[float] = None  # a multi-turn row's summed environment reward; None for single-turn rows
    sample_id: str = ""


@dataclass
class ScoreResult:
    """reward: weighted, clipped; components: source name -> raw score; ref_logprobs: (response_len,)."""

    reward: float
    components: dict[str, float]
    ref_logprobs: list[float]


def build_reward_sources(cfg) -> list[RewardSource]:
    """One RewardSource per `cfg.reward.sources` entry; model/remote sources are imported only when used.

    Raises ValueError when two sources share a name (their components would overwrite each other).
    """
    sources: list[RewardSource] = []
    for spec in cfg.reward.sources:
        name = spec.name or spec.kind
        if spec.kind == "function":
            from engines.rewards.function import FunctionRewardSource

            sources.append(
                FunctionRewardSource(
                    spec.target,
                    timeout_s=spec.timeout_s,
                    batch_size=spec.batch_size,
                    name=name,
                    isolation=spec.isolation,
                )
            )
        elif spec.kind == "environment":
            from engines.rewards.environment import EnvironmentRewardSource

            sources.append(EnvironmentRewardSource(name=name))
        elif spec.kind == "model":
            from engines.rewards.model import RewardModelSource

            sources.append(
                RewardModelSource(
                    spec.target,
                    name=name,
                    batch_size=spec.batch_size,
                    dtype=cfg.model.dtype,
                    quantize=spec.quantize,
                    token_budget=cfg.score.token_budget,
                )
            )
        else:
            from engines.rewards.remote import RemoteRewardSource

            sources.append(
                RemoteRewardSource(
                    spec.target,
                    name=name,
                    token=os.environ.get(spec.token_env),
                    timeout_s=spec.timeout_s,
                    batch_size=spec.batch_size,
                    max_retries=spec.max_retries,
                )
            )
    names = [s.name for s in sources]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"reward.sources: names {duplicates} are used twice; give each source a distinct `name`")
    return sources


def build_reference(cfg, policy_dir: str | None = None):
    """A frozen policy scored at the sampling temperature, with the trainer's precision and chunking: the reference
    (the initial policy, cfg.model.policy_path) unless `policy_dir` names another (a behaviour checkpoint)."""
    from engines.scoring.reference import ReferenceModel

    return ReferenceModel(
        policy_dir or cfg.model.policy_path,
        cfg.model.dtype,
        cfg.rollout.temperature,
        cfg.train.micro_batch_size,
        cfg.model.attn_implementation,
        chunk_size=cfg.train.logprob_chunk,
        autocast_dtype=cfg.model.autocast_dtype,
    )


class Scorer:
    """Reward sources + reference. `identity` changes whenever a score could change."""

    def __init__(self, cfg, sources: Optional[list[RewardSource]] = None, reference=None):
        self.sources = list(sources) if sources is not None else build_reward_sources(cfg)
        weights = [s.weight for s in cfg.reward.sources]
        if sources is not None and len(weights) != len(self.sources):
            weights = [1.0] * len(self.sources)  # sources given directly: the config's weights do not apply
        self.weights = weights
        self.clip = cfg.reward.clip
        self.reference = reference if reference is not None else build_reference(cfg)
        self.temperature = cfg.rollout.temperature
        self.token_budget = cfg.score.token_budget

    @property
    def reward_inputs(self) -> tuple[str, ...]:
        """The inputs beyond the tokens any source reads ("label", "data_source"): part of the cache key. A
        source that does not declare `reward_inputs` is taken to read both."""
        read = set()
        for source in self.sources:
            read.update(getattr(source, "reward_inputs", ("label", "data_source")))
        return tuple(sorted(read))

    @property
    def identity(self) -> str:
        payload = {
            "sources": [[s.name, s.identity] for s in self.sources],
            "weights": self.weights,
            "clip": self.clip,
            "reference": getattr(self.reference, "fingerprint", None),
            "temperature": self.temperature,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def score(self, inputs: list[ScoringInput]) -> list[ScoreResult]:
        """Score every input. RewardError (naming the source and sample) propagates; nothing is defaulted."""
        if not inputs:
            return []
        batch = RewardBatch(
            prompts=[x.prompt for x in inputs],
            responses=[x.response for x in inputs],
            prompt_ids=[list(x.prompt_ids) for x in inputs],
            response_ids=[list(x.response_ids) for x in inputs],
            labels=[x.label for x in inputs],
            data_sources=[x.data_source for x in inputs],
            env_rewards=[x.env_reward for x in inputs],
            sample_ids=[x.sample_id or f"sample {i}" for i, x in enumerate(inputs)],
        )
        components: list[dict[str, float]] = [{} for _ in inputs]
        for source in self.sources:
            scores = source.score(batch)
            if len(scores) != len(inputs):
                raise RewardError(
                    f"reward source {source.name!r} returned {len(scores)} scores for {len(inputs)} samples"
                )
            for i, s in enumerate(scores):
                if not math.isfinite(s):
                    raise RewardError(f"reward source {source.name!r} returned {s} for {batch.sample_ids[i]}")
                components[i][source.name] = float(s)
        ref_logprobs = self.reference_logprobs(batch.prompt_ids, batch.response_ids)
        return [
            ScoreResult(reward=self.combine(components[i]), components=components[i], ref_logprobs=ref_logprobs[i])
            for i in range(len(inputs))
        ]

    def combine(self, components: dict[str, float]) -> float:
        """The scalar reward: weighted sum of the sources' raw scores, clipped to [-clip, clip]."""
        total = sum(w * components[s.name] for w, s in zip(self.weights, self.sources))
        return max(-self.clip, min(self.clip, total))

    def reference_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Reference log-probs in micro-batches grouped by length under `score.token_budget` padded tokens
        (sorted by length, so little compute goes to padding), the rows of one prompt kept together (its
        tokens then run once per micro-batch: engines/trainer/shared_prompt.py); returned in the input order."""
        out: list = [None] * len(prompt_ids)
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        cap = getattr(self.reference, "micro_batch_size", None)
        prompts = [tuple(p) for p in prompt_ids]
        with getattr(self.reference, "in_use", contextlib.nullcontext)():  # its weights' pages, once for all groups
            for group in token_budget_batches(lengths, self.token_budget, max_batch_rows=cap, keys=prompts):
                scored = self.reference.logprobs([prompt_ids[i] for i in group], [response_ids[i] for i in group])
                for i, logprobs in zip(group, scored):
                    out[i] = logprobs
        return out
