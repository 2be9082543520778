"""RMTrainer: Bradley-Terry reward-model training with DeepSpeed (the update stage's engine set-up).

One optimizer step = one batch of rm_train.batch_size pairs (engines/rm/batching.py), accumulated over
micro-batches of rm_train.micro_batch_size pairs. Each micro-batch is ONE forward over its 2b rows
(chosen rows, then rejected rows, left-padded), scores read at each row's last real token
(engines/rm/loss.sequence_scores), loss -log sigmoid(r_c - r_r - margin) (engines/rm/loss.bradley_terry).
Each micro-batch's loss is its pairs' summed loss over the step's pairs and DeepSpeed's own 1/accumulation
scaling is off (`scale_wrt_gas=False`), so the step's gradient is that of the step's mean loss however it
is split. (Like the PPO trainer, every rank trains on the whole batch: data-parallel sharding is not done.)

The engine comes from engines/trainer/deepspeed_setup.py: AdamW (torch fused), ZeRO stage train.zero_stage
(0-2; saving under 3 is not supported), gradient clipping train.max_grad_norm, LR warm-up and schedule from
the train section over the run's total steps. model.autocast_dtype and model.gradient_checkpointing apply.

State (`save` / constructor's `state_dir`): model/ (the HF sequence-classification folder) and trainer/
(optimizer, scheduler and engine counters, RNG states, rm_state.json with the step). With the step as the
data cursor, a trainer rebuilt from a saved state continues exactly as the one that saved it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

from engines.models import autocast, load_tokenizer
from engines.rm.batching import batch_for_step, collate, steps_per_epoch
from engines.rm.data import PreferenceData, PreferencePairs
from engines.rm.loss import bradley_terry, sequence_scores
from engines.rm.model import load_reward_model, save_reward_model
from engines.trainer.checkpoint import (
    engine_counters,
    load_optimizer,
    save_optimizer,
    set_engine_counters,
)
from engines.trainer.deepspeed_setup import (
    deepspeed_config,
    lr_multiplier,
    make_engine,
    setup_distributed,
    world_size,
)
from engines.trainer.state import load_nested, rng_state, save_nested, seed_rng, set_rng_state

STATE_FILE = "rm_state.json"


class RMTrainer:
    """Reward model + DeepSpeed engine + the preference data it trains on.

    cfg: PPOFlowConfig (sections rm_train, train, model, run). model_dir: the backbone, or a saved model/
    folder when resuming with `state_dir` (its trainer/). Raises what load_reward_model raises, and
    NotImplementedError for train.zero_stage 3.
    """

    def __init__(self, cfg, data: PreferenceData, model_dir: str, state_dir: Optional[str] = None):
        if cfg.train.zero_stage == 3:
            raise NotImplementedError("reward-model training under train.zero_stage=3 is not supported; use 0, 1 or 2")
        setup_distributed()
        if state_dir is None:
            seed_rng(cfg.run.seed)  # the new score head's draw (and the states saved) depend on the run alone
        self.cfg, self.rm, self.data = cfg, cfg.rm_train, data
        self.tokenizer = load_tokenizer(model_dir)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.steps_per_epoch = steps_per_epoch(len(data.train), self.rm.batch_size)
        self.total_steps = self.rm.epochs * self.steps_per_epoch
        self.lengths = data.train.lengths()
        model = load_reward_model(model_dir, self.pad_token_id, cfg.model.dtype, cfg.model.attn_implementation)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        train_cfg = cfg.train.model_copy(update={"micro_batch_size": self.rm.micro_batch_size})
        factor = lr_multiplier(cfg.train.warmup_steps, self.total_steps, cfg.train.lr_schedule)
        self.engine = make_engine(
            model,
            # autocast_dtype: DeepSpeed turns the caller's autocast off in its engine unless told (deepspeed_config)
            deepspeed_config(
                train_cfg, cfg.model.dtype, self.rm.batch_size, self.rm.lr, cfg.model.autocast_dtype, world=world_size()
            ),
            factor,
        )
        self.step = 0
        if state_dir is not None:
            self._load_state(Path(state_dir))

    @property
    def device(self) -> torch.device:
        return next(self.engine.module.parameters()).device

    def _scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with autocast(self.cfg.model.autocast_dtype, self.device):
            return sequence_scores(self.engine, input_ids.to(self.device), attention_mask.to(self.device))

    # -- training ----------------------------------------------------------------------------------------
    def train_steps(self, until_step: int) -> dict[str, float]:
        """Optimizer steps self.step .. until_step - 1; returns their mean loss, accuracy, margin, last LR and
        grad norm. Raises ValueError when until_step is not after self.step or past the run's total steps."""
        if not self.step < until_step <= self.total_steps:
            raise ValueError(f"cannot train steps {self.step}..{until_step - 1}: the run has {self.total_steps} steps")
        self.engine.module.train()
        sums = {"rm/loss": 0.0, "rm/accuracy": 0.0, "rm/margin": 0.0}
        steps = until_step - self.step
        grad_norm = None
        while self.step < until_step:
            indices = batch_for_step(self.lengths, self.rm.batch_size, self.cfg.run.seed, self.step)
            for start in range(0, len(indices), self.rm.micro_batch_size):
                batch = collate(self.data.train, indices[start : start + self.rm.micro_batch_size], self.pad_token_id)
                scores = self._scores(batch.input_ids, batch.attention_mask)
                stats = bradley_terry(scores[: batch.pairs], scores[batch.pairs :], batch.margins.to(scores.device))
                share = batch.pairs / len(indices)  # this micro-batch's part of the step's mean
                self.engine.backward(stats.loss * share, scale_wrt_gas=False)
                self.engine.step()
                for key, value in (
                    ("rm/loss", stats.loss),
                    ("rm/accuracy", stats.accuracy),
                    ("rm/margin", stats.margin_mean),
                ):
                    sums[key] += float(value.detach()) * share / steps
            grad_norm = self.engine.get_global_grad_norm()  # None where DeepSpeed did not compute one
            self.step += 1
        metrics = {
            **sums,
            "optim/lr": float(self.engine.get_lr()[0]),
            "rm/step": self.step,
            "rm/epoch": self.step / self.steps_per_epoch,
        }
        if grad_norm is not None:
            metrics["optim/grad_norm"] = float(grad_norm)
        return metrics

    @torch.no_grad()
    def score_pairs(self, pairs: PreferencePairs) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (P,) of the chosen and of the rejected sides, in pair order; micro-batches sorted by length."""
        self.engine.module.eval()
        order = sorted(range(len(pairs)), key=lambda i: pairs.lengths()[i])
        chosen, rejected = torch.empty(len(pairs)), torch.empty(len(pairs))
        for start in range(0, len(order), self.rm.micro_batch_size):
            indices = order[start : start + self.rm.micro_batch_size]
            batch = collate(pairs, indices, self.pad_token_id)
            scores = self._scores(batch.input_ids, batch.attention_mask).cpu()
            chosen[indices], rejected[indices] = scores[: batch.pairs], scores[batch.pairs :]
        self.engine.module.train()
        return chosen, rejected

    def evaluate(self) -> dict[str, float]:
        """Eval loss, accuracy and margin, and the mean / std of all eval scores (both sides); {} without eval pairs."""
        pairs = self.data.eval
        if len(pairs) == 0:
            return {}
        chosen, rejected = self.score_pairs(pairs)
        stats = bradley_terry(chosen, rejected, torch.tensor(pairs.margins, dtype=torch.float32))
        both = torch.cat([chosen, rejected])
        std = float(both.std()) if both.numel() > 1 else 0.0
        return {
            "rm/eval_loss": float(stats.loss),
            "rm/eval_accuracy": float(stats.accuracy),
            "rm/eval_margin": float(stats.margin_mean),
            "rm/eval_score_mean": float(both.mean()),
            "rm/eval_score_std": std if math.isfinite(std) else 0.0,
            "rm/eval_pairs": len(pairs),
        }

    # -- state -------------------------------------------------------------------------------------------
    def save(self, out_dir: str, extra_state: Optional[dict] = None) -> dict[str, str]:
        """out_dir/model/ (HF folder) and out_dir/trainer/; returns {relative path: sha256} of the hashed files."""
        out = Path(out_dir)
        model_files = save_reward_model(self.engine.module, self.tokenizer, out / "model")
        hashed = {f"model/{k}": v for k, v in model_files.items()}
        state_dir = out / "trainer"
        files = dict(save_optimizer(self.engine, state_dir, "optimizer"))
        files.update(save_nested(rng_state(), state_dir, "rng"))
        meta = {
            "step": self.step,
            "total_steps": self.total_steps,
            "engine": engine_counters(self.engine),
            "extra_state": extra_state or {},
        }
        (state_dir / STATE_FILE).write_text(json.dumps(meta, indent=1))
        (state_dir / "config.json").write_text(json.dumps(self.cfg.model_dump(mode="json"), indent=1))
        hashed.update({f"trainer/{k}": v for k, v in files.items()})
        return hashed

    def _load_state(self, folder: Path) -> None:
        meta_path = folder / STATE_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"reward-model trainer state {meta_path} is missing")
        meta = json.loads(meta_path.read_text())
        if meta["total_steps"] != self.total_steps:
            raise ValueError(
                f"trainer state {folder} was saved by a run of {meta['total_steps']} steps; this one "
                f"has {self.total_steps} (the data or rm_train.epochs / batch_size changed)"
            )
        load_optimizer(self.engine, folder, "optimizer")
        set_engine_counters(self.engine, meta["engine"])
        self.step = int(meta["step"])
        set_rng_state(load_nested(folder, "rng"))
