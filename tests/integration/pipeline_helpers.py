"""A small, fast pipeline config for integration tests (tiny model, HF engine, a few prompts)."""
from __future__ import annotations

from ppoflow.config import PPOFlowConfig, build_config


def small_config(root: str, run: str, model_dir, data_dir, iterations: int = 2, **sections) -> PPOFlowConfig:
    data = {
        "run": {"name": run, "root": root, "iterations": iterations, "seed": 3},
        "model": {"policy_path": str(model_dir)},
        "data": {"path": str(data_dir)},
        # HF generate keeps these tests free of vLLM's ~30 s start; vLLM has its own tests.
        "rollout": {"engine": "hf", "prompts_per_iteration": 8, "n_samples": 2, "max_new_tokens": 4},
        "algo": {"name": "ppo"},
        "train": {"micro_batch_size": 8, "ppo_epochs": 1, "actor_lr": 1e-3, "critic_lr": 1e-3, "zero_stage": 2},
        "pipeline": {"retries": 0, "retry_delay_s": 0},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return build_config(data, "test")
