"""The bare engine loop: one PPO iteration in memory, no Prefect, no storage.

    prompts_for_iteration -> rollout (generate) -> score (rewards + reference) -> update (DeepSpeed)
                          -> sync (the actor's weights into the rollout engine: in memory or via a saved folder)

Each stage is a separately callable function (`rollout_step`, `scoring_inputs`, `build_experience`,
`sync_policy`), so the Prefect pipeline calls the same pieces stage by stage, with shards in between.
`EngineLoop` strings them together and times each under `timing/<stage>`.

Seeds: dataset row r in iteration i is sampled with `prompt_sampling_seed(run.seed, i, r)`, so an
iteration's samples depend only on (seed, iteration, policy weights), not on what ran before in the
process, and the pipeline (tasks/rollout.py) draws the same samples as this loop.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from engines.data import PromptRecord, PromptSource
from engines.models import load_tokenizer
from engines.rollout.base import RolloutEngine, RolloutSample, SamplingSettings, prompt_sampling_seed
from engines.scoring.scorer import ScoreResult, Scorer, ScoringInput
from engines.trainer.experience import ExperienceBatch
from engines.trainer.ppo_trainer import PPOTrainer


def rollout_step(engine: RolloutEngine, prompt_source: PromptSource, cfg, iteration: int
                 ) -> tuple[list[PromptRecord], list[RolloutSample]]:
    """The iteration's prompts and n samples each, ordered by (prompt, sample)."""
    records = prompt_source.prompts_for_iteration(iteration, cfg.rollout.prompts_per_iteration, cfg.run.seed)
    seeds = [prompt_sampling_seed(cfg.run.seed, iteration, r.index) for r in records]
    samples = engine.generate([r.prompt_ids for r in records], SamplingSettings.from_config(cfg.rollout), seeds)
    return records, samples


def scoring_inputs(tokenizer, records: list[PromptRecord], samples: list[RolloutSample],
                   iteration: int) -> list[ScoringInput]:
    """One ScoringInput per sample; the response text is decoded without special tokens (EOS, pad)."""
    inputs = []
    for s in samples:
        record = records[s.prompt_index]
        inputs.append(ScoringInput(
            prompt=record.text, response=tokenizer.decode(s.response_ids, skip_special_tokens=True),
            prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids), label=record.label,
            data_source=record.data_source,
            sample_id=f"iter {iteration} prompt {record.index} sample {s.sample_index}"))
    return inputs


def build_experience(samples: list[RolloutSample], results: list[ScoreResult], pad_token_id: int) -> ExperienceBatch:
    """Padded tensors for the update; samples of one prompt form one group (rows stay in prompt order)."""
    if len(samples) != len(results):
        raise ValueError(f"{len(samples)} samples but {len(results)} score results")
    return ExperienceBatch.from_lists(
        prompt_ids=[s.prompt_ids for s in samples], response_ids=[s.response_ids for s in samples],
        scores=[r.reward for r in results], ref_logprobs=[r.ref_logprobs for r in results],
        rollout_logprobs=[s.rollout_logprobs for s in samples], group_ids=[s.prompt_index for s in samples],
        pad_token_id=pad_token_id)


def sync_policy(trainer: PPOTrainer, engine: RolloutEngine, policy_dir: str | Path, version: int) -> None:
    """Make the rollout engine serve the trainer's actor as `version`.

    An engine that takes weights in memory (HF generate, in this process) gets the actor's state dict
    directly; others (vLLM, its own process) load the HF folder the actor is saved to at `policy_dir`.
    """
    load_state_dict = getattr(engine, "load_state_dict", None)
    weights = trainer.actor_weights()
    if load_state_dict is not None and weights is not None:
        from engines.rollout.registry import mark_served

        load_state_dict(weights, version)
        mark_served(engine, "memory", version)
        return
    trainer.save_policy(str(policy_dir))
    engine.load_weights(str(policy_dir), version)


def make_rollout_engine(cfg, policy_dir: str, version: int = 0) -> RolloutEngine:
    """The process's rollout engine from the registry (vLLM or HF generate by rollout.engine)."""
    from engines.rollout.registry import get_rollout_engine

    return get_rollout_engine(cfg.rollout, cfg.model, policy_dir, version, cfg.run.seed)


class EngineLoop:
    """Runs PPO iterations in memory. `work_dir` holds the policy folder used for weight sync when the
    rollout engine cannot take weights in memory, and the one `save_policy` writes."""

    def __init__(self, cfg, work_dir: Optional[str] = None):
        self.cfg = cfg
        # A folder the loop made itself is removed by shutdown(); a caller's folder is the caller's.
        self._owns_work_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="ppoflow-loop-"))
        self.tokenizer = load_tokenizer(cfg.model.policy_path)
        self.prompt_source = PromptSource(cfg.data, self.tokenizer, cfg.model.apply_chat_template)
        self.engine = make_rollout_engine(cfg, cfg.model.policy_path)
        self.scorer = Scorer(cfg)
        self.trainer = PPOTrainer(cfg, cfg.model.policy_path)
        self.policy_version = 0

    def run_iteration(self, iteration: int) -> dict[str, float]:
        """One iteration; returns the update's metrics plus timing/* and rollout/* figures."""
        t0 = time.perf_counter()
        records, samples = rollout_step(self.engine, self.prompt_source, self.cfg, iteration)
        t1 = time.perf_counter()
        results = self.scorer.score(scoring_inputs(self.tokenizer, records, samples, iteration))
        t2 = time.perf_counter()
        batch = build_experience(samples, results, self.tokenizer.pad_token_id)
        update = self.trainer.update(batch)
        t3 = time.perf_counter()
        self.policy_version += 1
        sync_policy(self.trainer, self.engine, self.work_dir / "policy", self.policy_version)
        t4 = time.perf_counter()
        metrics = dict(update.metrics)
        metrics.update({"iteration": iteration, "timing/rollout": t1 - t0, "timing/score": t2 - t1,
                        "timing/update": t3 - t2, "timing/sync": t4 - t3,
                        "rollout/stop_fraction": sum(s.finish_reason == "stop" for s in samples) / len(samples)})
        return metrics

    def save_policy(self) -> Path:
        """The actor as it is now, saved as an HF folder under work_dir (from_pretrained loads it)."""
        policy_dir = self.work_dir / "policy"
        self.trainer.save_policy(str(policy_dir))
        return policy_dir

    def shutdown(self) -> None:
        """Shut the rollout engine down through the registry (which would otherwise hand it out again),
        and remove work_dir when the loop made it (a policy `save_policy` wrote there goes with it)."""
        from engines.rollout.registry import shutdown_all

        shutdown_all()
        if self._owns_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
