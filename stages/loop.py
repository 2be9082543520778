"""The bare engine loop: PPO iterations in memory, no Prefect, no storage.

    sample_rollout -> score_rows -> train_on -> sync (the actor's weights into the rollout engine)

The three compute steps are the stages' own (stages/rollout.py, score.py, update.py): the pipeline
runs the same functions and writes their tables to shards in between, this loop passes the tables in
memory. Its rollout goes through the rollout stage's own engine step too (stages/engine_replacement.py's
with_live_engine): the engine is attested before it samples (stages/attest.py), against the record this loop took
of the weights as it handed them over (from the trainer's tensors, or from the folder it had just saved, before the
engine read it), and an engine whose process dies is replaced. A sync that did not reach the engine, or a policy
folder replaced between the save and the load, fails the iteration with AttestationError.
`EngineLoop` strings them together and times each under `timing/<stage>`; it is the baseline the
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
from engines.weights_digest import policy_record, state_dict_record
from ppoflow.config import ConfigError
from stages.attest import remember_record
from stages.dynamic import sample_dynamic
from stages.engine_replacement import with_live_engine
from stages.manifests import PolicyRef
from stages.policy import initial_policy_ref
from stages.rollout import sample_records, sample_rollout
from stages.score import score_rows
from stages.update import train_on


def sync_policy(
    trainer: PPOTrainer, engine: RolloutEngine, policy_dir: str | Path, version: int, autocast_dtype=None
) -> dict:
    """Make the rollout engine serve the trainer's actor as `version`; the record of the weights handed over
    (engines/weights_digest.policy_record's JSON, rounded to `autocast_dtype` too), what attestation compares with.

    An engine that takes weights in memory (HF generate, in this process) gets the actor's state dict
    directly; others (vLLM, its own process) load the HF folder the actor is saved to at `policy_dir`, whose
    record is taken right after the save, before the engine reads it (as the trainer records a checkpoint's).
    """
    load_state_dict = getattr(engine, "load_state_dict", None)
    weights = trainer.actor_weights()
    if load_state_dict is not None and weights is not None:
        from engines.rollout.registry import mark_served

        record = state_dict_record(weights, autocast_dtype)
        load_state_dict(weights, version)
        mark_served(engine, "memory", version)
        return record
    trainer.save_policy(str(policy_dir))
    record = policy_record(policy_dir, autocast_dtype)
    engine.load_weights(str(policy_dir), version)
    return record


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
        self.policy = initial_policy_ref(cfg)  # what the engine must serve (stages/attest.py)

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
        self._sync(self.engine)
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

    def _sync(self, engine: RolloutEngine) -> None:
        """Hand the trainer's actor to `engine` as self.policy_version; self.policy names it, with its record."""
        autocast_dtype = self.cfg.model.autocast_dtype
        record = sync_policy(self.trainer, engine, self.work_dir / "policy", self.policy_version, autocast_dtype)
        self.policy = PolicyRef(
            version=self.policy_version,
            checkpoint_iteration=None,
            uri=str(self.work_dir / "policy"),
            weights_id=f"loop-{self.policy_version}-{record['value']}",
        )
        remember_record(self.policy, autocast_dtype, record)

    def _replacement(self, cfg, policy: PolicyRef) -> RolloutEngine:
        """A new engine for `policy` after self.engine died (with_live_engine discarded it from the registry):
        built from the initial folder, then handed the trainer's actor when the policy has moved since."""
        self.engine = make_rollout_engine(cfg, cfg.model.policy_path)
        if policy.version > 0:
            self._sync(self.engine)
        return self.engine

    def _sample(self, iteration: int):
        """The rollout rows, and dynamic sampling's rollout/* metrics ({} when rollout.dynamic_sampling is off):
        the stage's own rounds (stages/dynamic.py), scored by this loop's scorer without a cache; through the
        rollout stage's engine step (attested, replaced when its process dies). timing/attest: the check's seconds."""
        source, cfg = self.prompt_source, self.cfg

        def sample(engine):
            if not cfg.rollout.dynamic_sampling.enabled:
                return sample_rollout(engine, source, cfg, iteration), {}
            return sample_dynamic(
                lambda records: sample_records(engine, source, cfg, iteration, records),
                source,
                cfg,
                iteration,
                lambda table: score_rows(self.scorer, table, cache=None)[0].column("reward").to_pylist(),
            )

        live = [self.engine]  # the first call takes the loop's engine, a call after a death builds a new one
        engine_for = lambda cfg, policy: live.pop() if live else self._replacement(cfg, policy)  # noqa: E731
        (rows, metrics), self.engine, attested, _ = with_live_engine(
            engine_for, cfg, self.policy, "rollout", iteration, sample
        )
        return rows, {**metrics, **({"timing/attest": attested.seconds} if attested is not None else {})}

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
