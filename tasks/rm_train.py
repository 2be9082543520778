"""Reward-model training tasks: prepare (check the data, plan the units), train one unit, export the model.

A unit is rm_train.steps_per_unit optimizer steps (one epoch when None). Each unit task trains its steps,
evaluates, writes its checkpoint (model/ + trainer/: weights, optimizer, scheduler, RNG; the step is the
data cursor) and commits it with the PPO checkpoints' protocol (storage/checkpoints.py: staged files, the
_COMMITTED marker last, LATEST, retention), as "iteration" = unit number. A flow run that dies resumes at
LATEST + 1 from that committed state; a Retry also finds finished tasks by their cache keys, which hash
the run, the unit, the input references and the config sections the result depends on.

The trainer and the tokenized data stay warm in the worker process between units (engines/warm.py); the
trainer is taken out of the warm cache while it trains and put back only once its new state is committed,
so a failure half-way makes the retry rebuild it from the last commit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prefect import task

from engines import warm
from engines.models import load_tokenizer
from engines.rm.batching import steps_per_epoch
from engines.rm.data import PreferenceData, PreferenceDataError, load_preferences
from engines.rm.model import NORMALIZATION_FILE, SUMMARY_FILE
from engines.rm.trainer import RMTrainer
from ppoflow.config import PPOFlowConfig, as_config
from ppoflow.fingerprint import folder_fingerprint
from ppoflow.fingerprint import json_hash as stable_hash
from storage import fs as fsutil
from storage.checkpoints import (
    commit_checkpoint,
    load_checkpoint,
    read_commit_marker,
    save_checkpoint_files,
)
from storage.layout import layout_for
from storage.scratch import checkpoint_scratch

RM_SECTIONS = ("model", "train", "rm_train")  # what a unit's result depends on, besides its inputs
OUTPUT_FOLDER = "reward_model"  # <root>/<run>/reward_model/: the trained model, loadable as it is


def base_model_path(cfg: PPOFlowConfig) -> str:
    return os.path.abspath(cfg.rm_train.base_model or cfg.model.policy_path)


def _data_identity(cfg: PPOFlowConfig) -> str:
    """Changes when the data files, the backbone's tokenizer files or the rm_train settings change."""
    rm = cfg.rm_train
    return stable_hash(
        {
            "data": _files_id(rm.data_path),
            "eval": _files_id(rm.eval_path) if rm.eval_path else [],
            "model": _files_id(base_model_path(cfg)),
            "rm_train": rm.model_dump(mode="json"),
            "seed": cfg.run.seed,
        }
    )


def preference_data(cfg: PPOFlowConfig) -> PreferenceData:
    """The tokenized train / eval pairs, built once per process and data version."""
    return warm.get_or_build(
        warm.WarmKey(warm.Role.RM_DATA, _data_identity(cfg)),
        lambda: load_preferences(cfg.rm_train, load_tokenizer(base_model_path(cfg)), cfg.run.seed),
    )


def run_rm_prepare(config: PPOFlowConfig | dict) -> dict[str, Any]:
    """Check and tokenize the pairs (errors name the row before any training) -> the plan of units."""
    cfg = as_config(config)
    rm = cfg.rm_train
    data = preference_data(cfg)
    if rm.normalize and len(data.eval) == 0:
        raise PreferenceDataError("rm_train.normalize needs eval pairs (rm_train.eval_path or eval_fraction > 0)")
    per_epoch = steps_per_epoch(len(data.train), rm.batch_size)
    total = per_epoch * rm.epochs
    per_unit = min(rm.steps_per_unit or per_epoch, total)
    return {
        "train_pairs": len(data.train),
        "eval_pairs": len(data.eval),
        "dropped": data.dropped,
        "steps_per_epoch": per_epoch,
        "total_steps": total,
        "steps_per_unit": per_unit,
        "units": -(-total // per_unit),
        "content_hash": _data_identity(cfg),
    }


def unit_steps(plan: dict[str, Any], unit: int) -> tuple[int, int]:
    """(first step, step after the last) of `unit` (1-based)."""
    if not 1 <= unit <= plan["units"]:
        raise ValueError(f"unit {unit} is outside 1..{plan['units']}")
    first = (unit - 1) * plan["steps_per_unit"]
    return first, min(first + plan["steps_per_unit"], plan["total_steps"])


def start_ref(cfg: PPOFlowConfig, unit: int) -> dict[str, Any]:
    """Where `unit` starts: the backbone (unit 1) or unit - 1's committed checkpoint, with a content hash."""
    if unit <= 1:
        path = base_model_path(cfg)
        return {"unit": 0, "uri": path, "content_hash": "initial-" + folder_fingerprint(path)[:20]}
    layout = layout_for(cfg)
    marker = read_commit_marker(layout, unit - 1)
    if marker is None:
        raise RuntimeError(
            f"reward-model unit {unit} needs unit {unit - 1}'s committed checkpoint, but "
            f"{layout.url(layout.checkpoint_dir(unit - 1))} has no commit marker"
        )
    return {"unit": unit - 1, "uri": layout.url(layout.checkpoint_dir(unit - 1)), "content_hash": stable_hash(marker)}


def _take_trainer(cfg: PPOFlowConfig, data: PreferenceData, start: dict[str, Any]) -> RMTrainer:
    held = warm.take(warm.WarmKey(warm.Role.RM_TRAINER, start["content_hash"]))
    if held is not None:
        return held
    if start["unit"] == 0:
        return RMTrainer(cfg, data, start["uri"])
    local = load_checkpoint(layout_for(cfg), start["unit"])
    return RMTrainer(cfg, data, os.path.join(local, "model"), state_dir=os.path.join(local, "trainer"))


def run_rm_unit(config: PPOFlowConfig | dict, unit: int, plan: dict[str, Any], start: dict[str, Any]) -> dict[str, Any]:
    """Train unit `unit` from `start` (start_ref), evaluate, commit its checkpoint -> the unit's manifest."""
    cfg = as_config(config)
    started = time.perf_counter()
    layout = layout_for(cfg)
    data = preference_data(cfg)
    trainer = _take_trainer(cfg, data, start)
    first, until = unit_steps(plan, unit)
    if trainer.step != first:
        raise RuntimeError(
            f"reward-model unit {unit} starts at step {first}, but the trainer from {start['uri']} "
            f"is at step {trainer.step}"
        )
    train_started = time.perf_counter()
    metrics = trainer.train_steps(until)
    metrics["timing/step"] = (time.perf_counter() - train_started) / (until - first)
    metrics.update(trainer.evaluate())
    with checkpoint_scratch(layout) as tmp:
        hashed = trainer.save(tmp, extra_state={"unit": unit, "metrics": metrics})
        staged = save_checkpoint_files(layout, unit, tmp, move=True, known_sha256=hashed)
    marker = commit_checkpoint(
        layout,
        unit,
        {"unit": unit, "metrics": metrics, "files_hash": stable_hash(staged)},
        keep_last=cfg.run.keep_checkpoints,
    )
    content_hash = stable_hash(marker)
    warm.put(warm.WarmKey(warm.Role.RM_TRAINER, content_hash), trainer)  # holds exactly the committed state
    return {
        "stage": "rm-unit",
        "unit": unit,
        "steps": [first, until],
        "metrics": metrics,
        "checkpoint_uri": layout.url(layout.checkpoint_dir(unit)),
        "content_hash": content_hash,
        "seconds": time.perf_counter() - started,
    }


def run_rm_export(config: PPOFlowConfig | dict, plan: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
    """Copy the last unit's model/ to <run>/reward_model/ with rm_train.json (config, eval metrics) and,
    with rm_train.normalize, reward_normalization.json {mean, std} of the eval scores. Idempotent."""
    cfg = as_config(config)
    layout = layout_for(cfg)
    if final["unit"] != plan["units"]:
        raise RuntimeError(
            f"export needs the last unit ({plan['units']}) committed; {final['uri']} is unit {final['unit']}"
        )
    local = load_checkpoint(layout, final["unit"], parts=("model",))
    marker = read_commit_marker(layout, final["unit"])
    metrics = marker["meta"]["metrics"]
    target = fsutil.join(layout.run_dir, OUTPUT_FOLDER)
    fsutil.remove_tree(layout.fs, target)
    for path in sorted(Path(local, "model").iterdir()):
        fsutil.upload_file_atomic(layout.fs, str(path), fsutil.join(target, path.name))
    eval_metrics = {k: v for k, v in metrics.items() if k.startswith("rm/eval_")}
    fsutil.write_json(
        layout.fs,
        fsutil.join(target, SUMMARY_FILE),
        {"eval": eval_metrics, "plan": plan, "config": cfg.model_dump(mode="json")},
    )
    normalization = None
    if cfg.rm_train.normalize:
        std = metrics["rm/eval_score_std"]
        normalization = {"mean": metrics["rm/eval_score_mean"], "std": std if std > 0 else 1.0}
        fsutil.write_json(layout.fs, fsutil.join(target, NORMALIZATION_FILE), normalization)
    return {
        "stage": "rm-export",
        "uri": layout.url(target),
        "eval": eval_metrics,
        "normalization": normalization,
        "content_hash": final["content_hash"],
    }


def rm_cache_key_fn(step: str):
    """A Prefect cache_key_fn: run / step / unit / hash(input references, RM_SECTIONS, seed, root)."""

    def _key(_context, parameters: dict[str, Any]) -> str:
        cfg = as_config(parameters["config"])
        inputs = {
            k: (v.get("content_hash") if isinstance(v, dict) and "content_hash" in v else v)
            for k, v in parameters.items()
            if k != "config"
        }
        if step == "prepare":  # nothing upstream: the data files themselves are the input
            inputs["data"] = _data_identity(cfg)
        digest = stable_hash(
            {"inputs": inputs, "config": cfg.section_hash(*RM_SECTIONS), "seed": cfg.run.seed, "root": cfg.run.root}
        )
        unit = parameters.get("unit")
        return f"{cfg.run.name}-rm-{step}{'' if unit is None else f'-{unit:06d}'}-{digest}"

    return _key


_json = {"persist_result": True, "result_serializer": "json"}
rm_prepare_task = task(run_rm_prepare, name="rm-prepare", cache_key_fn=rm_cache_key_fn("prepare"), **_json)
rm_unit_task = task(
    run_rm_unit, name="rm-unit", task_run_name="rm-unit-{unit}", cache_key_fn=rm_cache_key_fn("unit"), **_json
)
rm_export_task = task(run_rm_export, name="rm-export", cache_key_fn=rm_cache_key_fn("export"), **_json)


def _files_id(path) -> str | None:
    """The fingerprint of a local file or folder (ppoflow/fingerprint.py); None when it does not exist."""
    return folder_fingerprint(path) if path and os.path.exists(path) else None
