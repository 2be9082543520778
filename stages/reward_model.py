"""The reward-model training stages, each ONE function, pure of Prefect (`ppoflow train-rm`, flows/rm_training.py):

    run_rm_prepare(cfg)                                   -> RMPlan            (check and tokenize the pairs)
    run_rm_unit(cfg, unit, RMPlan, RMCheckpointRef)       -> RMUnitManifest    (train, evaluate, commit one unit)
    run_rm_export(cfg, RMPlan, RMCheckpointRef)           -> RMExportManifest  (<run>/reward_model/)
    start_ref(cfg, unit)                                  -> RMCheckpointRef   (where `unit` starts)

A unit is rm_train.steps_per_unit optimizer steps (one epoch when None). Each unit trains its steps, evaluates,
writes its checkpoint (model/ + trainer/: weights, optimizer, scheduler, RNG; the step is the data cursor) and
commits it with the PPO checkpoints' protocol (storage/checkpoints.py: staged files, the _COMMITTED marker last,
LATEST, retention), as "iteration" = unit number. A flow run that dies resumes at LATEST + 1 from that committed
state; a Retry also finds finished units by their cache keys (tasks/cache_keys.py).

The trainer and the tokenized data stay warm in the process between units (engines/warm.py); the trainer is taken
out of the warm cache while it trains and put back only once its new state is committed, so a failure half-way
makes the retry rebuild it from the last commit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from engines import warm
from engines.models import load_tokenizer
from engines.rm.batching import steps_per_epoch
from engines.rm.data import PreferenceData, PreferenceDataError, load_preferences
from engines.rm.model import NORMALIZATION_FILE, SUMMARY_FILE
from engines.rm.trainer import RMTrainer
from ppoflow.config import PPOFlowConfig
from ppoflow.fingerprint import folder_fingerprint, json_hash
from stages.manifests import RMCheckpointRef, RMExportManifest, RMPlan, RMUnitManifest, provenance
from storage import fs as fsutil
from storage.checkpoints import commit_checkpoint, load_checkpoint, read_commit_marker, save_checkpoint_files
from storage.layout import layout_for
from storage.scratch import checkpoint_scratch

OUTPUT_FOLDER = "reward_model"  # <root>/<run>/reward_model/: the trained model, loadable as it is


def base_model_path(cfg: PPOFlowConfig) -> str:
    return os.path.abspath(cfg.rm_train.base_model or cfg.model.policy_path)


def data_identity(cfg: PPOFlowConfig) -> str:
    """Changes when the data files, the backbone's files (its tokenizer) or the rm_train settings change."""
    rm = cfg.rm_train
    return json_hash(
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
        warm.WarmKey(warm.Role.RM_DATA, data_identity(cfg)),
        lambda: load_preferences(cfg.rm_train, load_tokenizer(base_model_path(cfg)), cfg.run.seed),
    )


def run_rm_prepare(cfg: PPOFlowConfig) -> RMPlan:
    """Check and tokenize the pairs (errors name the row, before any training) -> the plan of units.

    PreferenceDataError: a bad row (engines/rm/data.py), or rm_train.normalize without eval pairs."""
    rm = cfg.rm_train
    data = preference_data(cfg)
    if rm.normalize and len(data.eval) == 0:
        raise PreferenceDataError("rm_train.normalize needs eval pairs (rm_train.eval_path or eval_fraction > 0)")
    per_epoch = steps_per_epoch(len(data.train), rm.batch_size)
    total = per_epoch * rm.epochs
    per_unit = min(rm.steps_per_unit or per_epoch, total)
    return RMPlan(
        train_pairs=len(data.train),
        eval_pairs=len(data.eval),
        dropped=data.dropped,
        steps_per_epoch=per_epoch,
        total_steps=total,
        steps_per_unit=per_unit,
        units=-(-total // per_unit),
        data_id=data_identity(cfg),
    )


def start_ref(cfg: PPOFlowConfig, unit: int) -> RMCheckpointRef:
    """Where `unit` starts: the backbone (unit 1) or unit - 1's committed checkpoint (RuntimeError when it has no
    commit marker). start_ref(cfg, units + 1) is the last unit's checkpoint, which the export copies."""
    if unit <= 1:
        path = base_model_path(cfg)
        return RMCheckpointRef(unit=0, uri=path, content_id="initial-" + folder_fingerprint(path)[:20])
    layout = layout_for(cfg)
    marker = read_commit_marker(layout, unit - 1)
    if marker is None:
        raise RuntimeError(
            f"reward-model unit {unit} needs unit {unit - 1}'s committed checkpoint, but "
            f"{layout.url(layout.checkpoint_dir(unit - 1))} has no commit marker"
        )
    return RMCheckpointRef(
        unit=unit - 1, uri=layout.url(layout.checkpoint_dir(unit - 1)), content_id=checkpoint_id(marker)
    )


def commit_unit(
    cfg: PPOFlowConfig, unit: int, local_dir: str, metrics: dict, known_sha256: dict[str, str] | None = None
) -> str:
    """Stage the files of `local_dir` (given up: moved where the storage allows) as `unit`'s checkpoint and commit
    it, the unit's metrics in the marker's meta (flows/rm_training.restore_last_row reads them) -> its content id.
    CheckpointError when `unit` is already committed (storage/checkpoints.py never overwrites one)."""
    layout = layout_for(cfg)
    staged = save_checkpoint_files(layout, unit, local_dir, move=True, known_sha256=known_sha256)
    meta = {"unit": unit, "metrics": metrics, "files_hash": json_hash(staged)}
    return checkpoint_id(commit_checkpoint(layout, unit, meta, keep_last=cfg.run.keep_checkpoints))


def checkpoint_id(marker: dict) -> str:
    """A committed unit's content id, from its commit marker: "ckpt-" + the hash of its files' sha256 list and sizes
    (not the marker's commit time or the unit's timings), so equal weights and state have one id."""
    return "ckpt-" + marker["meta"]["files_hash"]


def _take_trainer(cfg: PPOFlowConfig, data: PreferenceData, start: RMCheckpointRef) -> RMTrainer:
    held = warm.take(warm.WarmKey(warm.Role.RM_TRAINER, start.content_id))
    if held is not None:
        return held
    if start.unit == 0:
        return RMTrainer(cfg, data, start.uri)
    local = load_checkpoint(layout_for(cfg), start.unit)
    return RMTrainer(cfg, data, os.path.join(local, "model"), state_dir=os.path.join(local, "trainer"))


def run_rm_unit(cfg: PPOFlowConfig, unit: int, plan: RMPlan, start: RMCheckpointRef) -> RMUnitManifest:
    """Train unit `unit` from `start` (start_ref), evaluate, commit its checkpoint -> the unit's manifest.

    RuntimeError when the trainer built from `start` is not at the unit's first step (the data or rm_train.epochs /
    batch_size changed under a resumed run)."""
    started = time.perf_counter()
    layout = layout_for(cfg)
    data = preference_data(cfg)
    trainer = _take_trainer(cfg, data, start)
    first, until = plan.unit_steps(unit)
    if trainer.step != first:
        raise RuntimeError(
            f"reward-model unit {unit} starts at step {first}, but the trainer from {start.uri} "
            f"is at step {trainer.step}"
        )
    train_started = time.perf_counter()
    metrics = trainer.train_steps(until)
    metrics["timing/step"] = (time.perf_counter() - train_started) / (until - first)
    metrics.update(trainer.evaluate())
    with checkpoint_scratch(layout) as tmp:
        hashed = trainer.save(tmp, extra_state={"unit": unit, "metrics": metrics})
        content_id = commit_unit(cfg, unit, tmp, metrics, known_sha256=hashed)
    warm.put(warm.WarmKey(warm.Role.RM_TRAINER, content_id), trainer)  # holds exactly the committed state
    return RMUnitManifest(
        iteration=unit,
        steps=(first, until),
        metrics=metrics,
        checkpoint_uri=layout.url(layout.checkpoint_dir(unit)),
        content_id=content_id,
        **provenance(started),
    )


def run_rm_export(cfg: PPOFlowConfig, plan: RMPlan, final: RMCheckpointRef) -> RMExportManifest:
    """Copy the last unit's model/ to <run>/reward_model/ with rm_train.json (config, plan, eval metrics) and, with
    rm_train.normalize, reward_normalization.json {mean, std} of the eval scores. Idempotent.

    RuntimeError when `final` is not the plan's last unit."""
    started = time.perf_counter()
    layout = layout_for(cfg)
    if final.unit != plan.units:
        raise RuntimeError(f"export needs the last unit ({plan.units}) committed; {final.uri} is unit {final.unit}")
    local = load_checkpoint(layout, final.unit, parts=("model",))
    metrics = read_commit_marker(layout, final.unit)["meta"]["metrics"]
    target = fsutil.join(layout.run_dir, OUTPUT_FOLDER)
    fsutil.remove_tree(layout.fs, target)
    for path in sorted(Path(local, "model").iterdir()):
        fsutil.upload_file_atomic(layout.fs, str(path), fsutil.join(target, path.name))
    eval_metrics = {k: v for k, v in metrics.items() if k.startswith("rm/eval_")}
    summary = {"eval": eval_metrics, "plan": plan.model_dump(mode="json"), "config": cfg.model_dump(mode="json")}
    fsutil.write_json(layout.fs, fsutil.join(target, SUMMARY_FILE), summary)
    normalization = None
    if cfg.rm_train.normalize:
        std = metrics["rm/eval_score_std"]
        normalization = {"mean": metrics["rm/eval_score_mean"], "std": std if std > 0 else 1.0}
        fsutil.write_json(layout.fs, fsutil.join(target, NORMALIZATION_FILE), normalization)
    return RMExportManifest(
        iteration=final.unit,
        uri=layout.url(target),
        eval=eval_metrics,
        normalization=normalization,
        content_id=final.content_id,
        **provenance(started),
    )


def _files_id(path) -> str | None:
    """The fingerprint of a local file or folder (ppoflow/fingerprint.py); None when it does not exist."""
    return folder_fingerprint(path) if path and os.path.exists(path) else None
