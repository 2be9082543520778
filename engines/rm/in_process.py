"""Reward-model training in one process, no Prefect and no storage: the benchmarks' and tests' path.

`train_reward_model(cfg, out_dir)` does what the `rm-training` flow does across its tasks (prepare, every unit's
steps, evaluate, export) with the same engine code (engines/rm/data.py, engines/rm/trainer.py), and writes the
same output folder: the HF sequence-classification model, rm_train.json (config and eval metrics) and, with
rm_train.normalize, reward_normalization.json {mean, std} of the eval scores (which the `kind: model` reward
source applies). No checkpoints: a killed call starts over (the flow is the resumable path).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from engines.models import load_tokenizer
from engines.rm.data import PreferenceDataError, load_preferences
from engines.rm.model import NORMALIZATION_FILE, SUMMARY_FILE, save_reward_model
from engines.rm.trainer import RMTrainer


def train_reward_model(cfg, out_dir: str | Path) -> dict[str, float]:
    """Train on cfg.rm_train's pairs for all epochs from the backbone, save to `out_dir` -> eval metrics + timing.

    Raises PreferenceDataError as the flow's prepare task does (bad rows; normalize without eval pairs).
    """
    base = cfg.rm_train.base_model or cfg.model.policy_path
    data = load_preferences(cfg.rm_train, load_tokenizer(base), cfg.run.seed)
    if cfg.rm_train.normalize and len(data.eval) == 0:
        raise PreferenceDataError("rm_train.normalize needs eval pairs (rm_train.eval_path or eval_fraction > 0)")
    trainer = RMTrainer(cfg, data, base)
    started = time.perf_counter()
    metrics = trainer.train_steps(trainer.total_steps)
    metrics["timing/train"] = time.perf_counter() - started
    metrics.update(trainer.evaluate())
    out = Path(out_dir)
    save_reward_model(trainer.engine.module, trainer.tokenizer, out)
    eval_metrics = {k: v for k, v in metrics.items() if k.startswith("rm/eval_")}
    (out / SUMMARY_FILE).write_text(json.dumps({"eval": eval_metrics, "config": cfg.model_dump(mode="json")}))
    if cfg.rm_train.normalize:
        std = metrics["rm/eval_score_std"]
        normalization = {"mean": metrics["rm/eval_score_mean"], "std": std if std > 0 else 1.0}
        (out / NORMALIZATION_FILE).write_text(json.dumps(normalization))
    return metrics
