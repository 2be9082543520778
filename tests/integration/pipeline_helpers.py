"""A small, fast pipeline config for integration tests (tiny model, HF engine, a few prompts)."""

from __future__ import annotations

from engines.toy.run_config import toy_config
from ppoflow.config import PPOFlowConfig

SMALL = {
    # HF generate keeps these tests free of vLLM's ~30 s start; vLLM has its own tests.
    "rollout": {"engine": "hf", "prompts_per_iteration": 8, "n_samples": 2, "max_new_tokens": 4},
    "data": {"data_source_key": None},
    "algo": {"name": "ppo", "kl_coef": 0.01},
    "train": {
        "micro_batch_size": 8,
        "train_batch_size": None,
        "ppo_epochs": 1,
        "actor_lr": 1e-3,
        "critic_lr": 1e-3,
        "zero_stage": 2,
        "warmup_steps": 0,
        "lr_schedule": "constant",
    },
    "pipeline": {"retries": 0, "retry_delay_s": 0},
}


def small_config(root: str, run_name: str, model_dir, data_dir, iterations: int = 2, **sections) -> PPOFlowConfig:
    merged = {name: dict(values) for name, values in SMALL.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return toy_config(root, run_name, model_dir, data_dir, iterations=iterations, seed=3, sections=merged)
