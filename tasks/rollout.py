"""The rollout stage: sample responses with the current policy and write them as rollout shards."""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import pyarrow as pa
from prefect import task

from engines import warm
from engines.data import PromptSource
from engines.models import load_tokenizer
from engines.rollout.base import RolloutEngine, RolloutSample, SamplingSettings, prompt_sampling_seed
from engines.rollout.registry import get_rollout_engine, serve_in_memory
from ppoflow.config import PPOFlowConfig
from storage.schema import schema_for
from storage.shards import write_shards
from tasks.common import STAGE_BODY_CALLS, as_config, cache_key_fn, layout_for, local_path_state
from tasks.policy import local_policy_dir
from tasks.update import held_trainer


def prompt_hash(prompt_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()


def rollout_table(samples: list[RolloutSample], prompts: list, tokenizer, iteration: int) -> pa.Table:
    """One row per sample, columns as in storage/schema.py's rollout schema."""
    rows: dict[str, list] = {k: [] for k in (
        "iteration", "prompt_index", "sample_index", "prompt_hash", "prompt", "response", "prompt_ids",
        "response_ids", "rollout_logprobs", "finish_reason", "policy_version", "label", "data_source")}
    for s in samples:
        record = prompts[s.prompt_index]
        rows["iteration"].append(iteration)
        rows["prompt_index"].append(record.index)
        rows["sample_index"].append(s.sample_index)
        rows["prompt_hash"].append(prompt_hash(s.prompt_ids))
        rows["prompt"].append(record.text)
        rows["response"].append(tokenizer.decode(s.response_ids, skip_special_tokens=True))
        rows["prompt_ids"].append(list(s.prompt_ids))
        rows["response_ids"].append(list(s.response_ids))
        rows["rollout_logprobs"].append([float(x) for x in s.rollout_logprobs])
        rows["finish_reason"].append(s.finish_reason)
        rows["policy_version"].append(s.policy_version)
        rows["label"].append(None if record.label is None else str(record.label))
        rows["data_source"].append(record.data_source)
    return pa.table(rows, schema=schema_for("rollout"))


def prompt_source_for(cfg: PPOFlowConfig) -> PromptSource:
    """The worker's tokenised prompt set, built once per data settings and tokenizer folder (tokenising the
    whole dataset every iteration would cost more than sampling on the tiny model); rebuilt when the data
    settings or the files change. The tokenizer is the initial model's: checkpoints save the same tokenizer
    files beside the policy weights."""
    key = json.dumps([cfg.section_hash("data"), os.path.abspath(cfg.model.policy_path), cfg.model.apply_chat_template,
                      local_path_state(cfg.data.path), local_path_state(cfg.model.policy_path)])
    return warm.get_or_build("prompts", key, lambda: PromptSource(
        cfg.data, load_tokenizer(cfg.model.policy_path), cfg.model.apply_chat_template))


def rollout_engine_for(cfg: PPOFlowConfig, policy: dict[str, Any]) -> RolloutEngine:
    """This process's rollout engine, serving the policy `policy` refers to (tasks/policy.py).

    When this process's warm trainer holds exactly that checkpoint (its content hash: the update wrote the
    checkpoint from these very tensors and nothing has moved them since) and the engine takes weights in
    memory, they are handed over directly; otherwise the checkpoint's policy/ is fetched, verified and loaded.
    """
    trainer = held_trainer(policy["content_hash"])
    if trainer is not None and (weights := trainer.actor_weights()) is not None:
        engine = serve_in_memory(cfg.rollout, cfg.model, weights, f"memory:{policy['content_hash']}",
                                 policy["version"])
        if engine is not None:
            return engine
    return get_rollout_engine(cfg.rollout, cfg.model, local_policy_dir(cfg, policy), policy["version"], cfg.run.seed)


def run_rollout(config: PPOFlowConfig | dict, iteration: int, policy: dict[str, Any]) -> dict[str, Any]:
    """Generate iteration `iteration`'s samples with the policy `policy` (tasks/policy.py) -> rollout manifest."""
    cfg = as_config(config)
    STAGE_BODY_CALLS["rollout"] += 1
    started = time.perf_counter()
    source = prompt_source_for(cfg)
    tokenizer = source.tokenizer
    prompts = source.prompts_for_iteration(iteration, cfg.rollout.prompts_per_iteration, cfg.run.seed)
    engine = rollout_engine_for(cfg, policy)
    seeds = [prompt_sampling_seed(cfg.run.seed, iteration, p.index) for p in prompts]
    samples = engine.generate([p.prompt_ids for p in prompts], SamplingSettings.from_config(cfg.rollout), seeds)
    layout = layout_for(cfg)
    stage_dir = layout.stage_dir(iteration, "rollout")
    manifest = write_shards(layout.fs, stage_dir, rollout_table(samples, prompts, tokenizer, iteration), "rollout",
                            max_rows=cfg.storage.shard_max_rows, max_bytes=cfg.storage.shard_max_bytes)
    return {"stage": "rollout", "iteration": iteration, "uri": layout.url(stage_dir), "rows": manifest.rows,
            "content_hash": manifest.content_hash, "policy_version": policy["version"], "engine": engine.name,
            "seconds": time.perf_counter() - started}


rollout_task = task(run_rollout, name="rollout", task_run_name="rollout-iter-{iteration}",
                    cache_key_fn=cache_key_fn("rollout"), persist_result=True, result_serializer="json")
