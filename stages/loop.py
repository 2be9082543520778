"""The bare engine loop: PPO iterations in memory, no Prefect, no storage.

    sample_rollout -> score_rows -> train_on -> sync (the actor's weights into the rollout engine)

The three compute steps are the stages' own (stages/rollout.py, score.py, update.py): the pipeline
runs the same functions and writes their tables to shards in between, this loop passes the tables in
memory. `EngineLoop` strings them together and times each under `timing/<stage>`; it is the baseline the
overhead and peer benchmarks measure the pipeline against. One rank only: train.num_ranks > 1 is refused
(ConfigError), since several ranks are a torchrun group of processes (stages/update_ranks.py), not this loop.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from engines.data import PromptSource
from engines.models import load_tokenizer
from engines.rollout.base import RolloutEngine
from engines.scoring.scorer import Scorer
from engines.trainer.ppo_trainer import PPOTrainer
from ppoflow.config import ConfigError
from stages.dynamic import sample_dynamic
from stages.rollout import sample_records, sample_rollout
from stages.score import score_rows
from stages.update import train_on


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
        if cfg.pipeline.max_staleness:
            raise ValueError(
                f"pipeline.max_staleness={cfg.pipeline.max_staleness}: the in-memory loop runs one iteration after "
                "another; pipelined iterations run through the training flow (ppoflow train)"
            )
        if cfg.train.num_ranks > 1:
            raise ConfigError(
                f"train.num_ranks={cfg.train.num_ranks}: the in-memory loop trains on one rank, in this process; "
                "several update ranks are a torchrun group, which `ppoflow train` starts itself (or serve the "
                "update with `torchrun --nproc-per-node=N --no-python ppoflow worker --stage update --stage "
                "checkpoint`); set train.num_ranks=1 here"
            )
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
        rollout, rollout_metrics = self._sample(iteration)
        t1 = time.perf_counter()
        scored, _ = score_rows(self.scorer, rollout, cache=None)
        t2 = time.perf_counter()
        update = train_on(self.trainer, scored)
        t3 = time.perf_counter()
        self.policy_version += 1
        sync_policy(self.trainer, self.engine, self.work_dir / "policy", self.policy_version)
        t4 = time.perf_counter()
        metrics = dict(update.metrics)
        metrics.update(rollout_metrics)
        metrics.update(
            {
                "iteration": iteration,
                "timing/rollout": t1 - t0,
                "timing/score": t2 - t1,
                "timing/update": t3 - t2,
                "timing/sync": t4 - t3,
                "rollout/stop_fraction": rollout.column("finish_reason").to_pylist().count("stop") / rollout.num_rows,
            }
        )
        return metrics

    def _sample(self, iteration: int):
        """The rollout rows, and dynamic sampling's rollout/* metrics ({} when rollout.dynamic_sampling is off):
        the stage's own rounds (stages/dynamic.py), scored by this loop's scorer without a cache."""
        if not self.cfg.rollout.dynamic_sampling.enabled:
            return sample_rollout(self.engine, self.prompt_source, self.cfg, iteration), {}
        source, cfg = self.prompt_source, self.cfg
        return sample_dynamic(
            lambda records: sample_records(self.engine, source, cfg, iteration, records),
            source,
            cfg,
            iteration,
            lambda table: score_rows(self.scorer, table, cache=None)[0].column("reward").to_pylist(),
        )

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
