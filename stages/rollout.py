"""The rollout stage: sample the iteration's prompts with the policy it starts from, write rollout shards.

    sample_rollout(engine, source, cfg, iteration) -> rollout rows   (the compute, shared with stages/loop.py)
    run_rollout(cfg, iteration, policy) -> RolloutManifest          (the stage: engine, compute, shards)

With pipeline.rollout_parts > 1 the stage runs as parts and a merge instead (stages/rollout_parts.py).

`build_initial_engine(cfg)` builds the engine for the initial policy before the flow starts, while Prefect's server
starts (flows/run.py), so a run's first rollout does not wait for it afterwards.

With rollout.dynamic_sampling.enabled the stage samples in rounds and keeps only groups with reward
variance (stages/dynamic.py); the manifest's `metrics` then holds the rounds' accounting.

Seeds: dataset row r in iteration i is sampled with `prompt_sampling_seed(run.seed, i, r)`, so an
iteration's samples depend only on (seed, iteration, policy weights), not on what ran before in the
process: a retried or resumed stage draws the same samples.
"""

from __future__ import annotations

import logging
import time
from typing import TypeVar

import pyarrow as pa

from engines import warm
from engines.data import PromptSource
from engines.rollout.base import RolloutEngine, SamplingSettings, prompt_sampling_seed
from engines.rollout.registry import get_rollout_engine, serve_in_memory
from stages.attest import expected_record
from stages.curriculum_state import iteration_level, tag_level
from stages.dynamic import sample_dynamic, stage_rewards
from stages.engine_replacement import with_live_engine
from stages.env_failures import env_failure_metrics
from stages.held import prompt_source_for, trainer_key
from stages.manifests import PolicyRef, RolloutManifest, ShardsManifest, provenance
from stages.policy import initial_policy_ref, local_policy_dir
from stages.tables import rollout_table, write_stage_table
from storage.layout import layout_for
from storage.shards import Manifest

M = TypeVar("M", bound=ShardsManifest)
log = logging.getLogger("ppoflow.rollout")


def sample_rollout(engine: RolloutEngine, source: PromptSource, cfg, iteration: int) -> pa.Table:
    """The iteration's prompts, n samples each, as rollout rows ordered by (prompt, sample)."""
    records = source.prompts_for_iteration(iteration, cfg.rollout.prompts_per_iteration, cfg.run.seed)
    return sample_records(engine, source, cfg, iteration, records)


def sample_records(engine: RolloutEngine, source: PromptSource, cfg, iteration: int, records: list) -> pa.Table:
    """These prompts (PromptRecord), n samples each, as rollout rows ordered by (prompt, sample); row r of the
    dataset is sampled with its own seed (module docstring), so which other prompts share the call is moot.
    With rollout.environment each sample is a conversation (stages/rollout_env.py)."""
    seeds = [prompt_sampling_seed(cfg.run.seed, iteration, r.index) for r in records]
    if cfg.rollout.environment is not None:  # multi-turn: conversations with the environment
        from stages.rollout_env import sample_conversations

        return sample_conversations(engine, source, cfg, iteration, records, seeds)
    return sample_table(engine, source, records, SamplingSettings.from_config(cfg.rollout), seeds, iteration)


def sample_table(
    engine: RolloutEngine, source: PromptSource, records: list, sampling: SamplingSettings, seeds: list, iteration: int
) -> pa.Table:
    """`records` sampled with `sampling` (seeds[i] for records[i]) as rollout rows: the rollout and eval stages'
    one way from prompts to rows. Raises the engine's error naming the prompt (too long for the model)."""
    samples = engine.generate([r.prompt_ids for r in records], sampling, seeds)
    return rollout_table(records, samples, source.tokenizer, iteration)


def sampled_manifest(model: type[M], written: Manifest, iteration: int, started: float, **fields) -> M:
    """The manifest (`model`: rollout, rollout part, eval) of shards `written` by a stage body that started at
    perf_counter() == `started` in this process; `fields` are the model's own (policy_version, engine, ...)."""
    shards = {"uri": written.uri, "rows": written.rows, "content_hash": written.content_hash}
    return model(iteration=iteration, **shards, **fields, **provenance(started))


def rollout_engine_for(cfg, policy: PolicyRef) -> RolloutEngine:
    """This process's rollout engine, serving the weights `policy` names.

    When this process's warm trainer holds exactly those weights (the update saved the checkpoint from these
    very tensors) and the engine takes weights in memory (HF generate), they are handed over directly;
    otherwise the checkpoint's policy/ is fetched, verified and loaded into the running engine. Not verified
    again when that warm trainer exists and the checkpoint is on local storage: this process hashed those files
    as it wrote them (0.8 s of SmolLM2's 0.5 GB a rollout, when vLLM loads them from the folder).
    """
    # Borrowed: with pipelined iterations the next update may take this trainer and train it meanwhile; it
    # waits until the engine has copied the weights.
    with warm.borrowed(trainer_key(policy.weights_id)) as trainer:
        if trainer is not None and (weights := trainer.actor_weights()) is not None:
            engine = serve_in_memory(cfg.rollout, cfg.model, weights, f"memory:{policy.weights_id}", policy.version)
            if engine is not None:
                return engine
        hashed_here = trainer is not None
    policy_dir = local_policy_dir(cfg, policy, hashed_here=hashed_here)
    return get_rollout_engine(cfg.rollout, cfg.model, policy_dir, policy.version, cfg.run.seed)


def build_initial_engine(cfg) -> None:
    """Build this process's rollout engine for the initial policy (version 0) now, before the flow starts.

    It is the engine iteration 1's rollout stage asks the registry for (same folder, version, seed and settings), so
    the stage finds it built. flows/run.py calls it while Prefect's temporary server starts, in the thread that runs
    the stage bodies later (torch's OpenMP team is per thread: runtime/workers.py). A build that fails is
    logged (to the run's log file) and left to the stage, which builds again and fails the run with its error."""
    try:
        policy = initial_policy_ref(cfg)
        rollout_engine_for(cfg, policy)  # the stage's own call, for the policy it starts from
        # and the initial folder's digest, which the stage's attestation would otherwise compute on its clock (kept
        # per weights_id: stages/attest.py)
        expected_record(cfg, policy)
    except Exception as e:  # noqa: BLE001 - the rollout stage builds it again and raises there
        log.warning("the rollout engine built before the flow failed (the rollout stage builds it again): %s", e)


def run_rollout(cfg, iteration: int, policy: PolicyRef) -> RolloutManifest:
    """Generate iteration `iteration`'s samples with `policy` and write them as the iteration's rollout shards.

    Writing again replaces the iteration's rollout folder (manifest last), so a retry never duplicates rows.
    """
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    level = iteration_level(cfg, policy)  # data.reasoning_gym.curriculum: the level `policy`'s checkpoint committed
    source = prompt_source_for(cfg, level)
    with warm.stage_lock("rollout"):  # pipelined iterations: one engine, one rollout at a time
        serving = time.perf_counter()
        sampling: list[float] = []  # when each call of `sample` began (more than one after an engine's death)

        def sample(engine):
            sampling.append(time.perf_counter())
            if not cfg.rollout.dynamic_sampling.enabled:
                return sample_rollout(engine, source, cfg, iteration), {}
            draw = lambda records: sample_records(engine, source, cfg, iteration, records)  # noqa: E731
            return sample_dynamic(draw, source, cfg, iteration, stage_rewards(cfg))

        # an engine whose process dies is built again and samples again (stages/engine_replacement.py)
        (table, metrics), engine, attested, replaced = with_live_engine(
            rollout_engine_for, cfg, policy, "rollout", iteration, sample
        )
        sampled = time.perf_counter()
    # where the stage's seconds go (bench.roofline): the engine made to serve the policy (its weights loaded and
    # attested; with replacements, every engine before the last sampling), then that sampling itself
    split = {"timing/rollout_serve": sampling[-1] - serving, "timing/rollout_sample": sampled - sampling[-1]}
    metrics = {**metrics, **split}
    written = write_stage_table(cfg, layout_for(cfg), iteration, "rollout", tag_level(table, level))
    return sampled_manifest(
        RolloutManifest,
        written,
        iteration,
        started,
        policy_version=policy.version,
        engine=engine.name,
        metrics={**metrics, **env_failure_metrics(table)},  # multi-turn: groups dropped for a failed environment
        attested=attested,
        engine_replacements=replaced,
    )
