"""Does PPO learn? The digits toy task on the tiny Llama, trained by the bare engine loop.

    python -m bench.learning --algo ppo            # GAE + critic
    python -m bench.learning --algo grpo           # group-normalised advantages, no critic
    python -m bench.learning --algo dr_grpo        # any algo.name of ppoflow/algorithms.py
    python -m bench.learning --algo ppo --engine vllm --iterations 40 --seconds 600
    python -m bench.learning --algo grpo --dynamic-sampling --seconds 300   # DAPO's filter; compare with it off

Baseline, in the same run: iteration 0's mean reward is the random-init policy (about 0.02 on digits).
Goal: the mean reward rises from <= 0.2 to >= 0.9 within 10 minutes on 2 CPU cores.

Prints one JSON line per iteration, then the summary line {"bench": "learning", "algo", "engine",
"first_reward", "final_reward", "iterations", "seconds", "reached_0.9_at_s", ...} (appended to
bench/results/learning.jsonl). first_reward = mean reward of iteration 0; final_reward = mean reward of the
last iteration's samples (sampled at the training temperature, not a greedy eval). With --dynamic-sampling the
reward is `rollout/first_round_reward_mean` (the iteration's own prompts, before the filter; reward/mean then
covers only the groups kept), so the two runs measure the same thing; compare them at equal --seconds.

The recipe (the defaults below; why each):
- 32 prompts x 4 samples, max_new_tokens 8 (the task's target length), temperature 1.0;
- actor_lr 5e-4 / critic_lr 5e-4, 2 warm-up steps, then cosine decay to 0 at the last iteration: the model
  is tiny (~0.6 M parameters) and randomly initialised, so it needs a far larger step than a pretrained LM;
  at a constant 5e-4 the policy, once near 1.0 with entropy ~0.02, drifts: single prompts collapse onto a
  wrong digit (reward dips to ~0.85) and near-deterministic tokens barely get a gradient back. The decay
  freezes the solved policy instead (1e-3 learns faster but collapses earlier);
- train_batch_size 64 (2 optimizer steps per iteration), micro_batch_size 32, ppo_epochs 2;
- kl_coef 0.001: the reference is a random model, so a strong pull towards it only slows learning;
- gamma = lam = 1 (OpenRLHF defaults), whitened advantages for ppo, group-normalised for grpo.
- the same recipe for every algorithm: each keeps its registry defaults (dr_grpo: Dr. GRPO's loss aggregation).

On a machine shared with other jobs, OMP_NUM_THREADS=1 keeps torch's threads from spinning against each other
(seen here: 25 s per iteration with the default threads under a load of 9, 1.6 s with one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import emit  # noqa: E402
from ppoflow.algorithms import ALGO_NAMES  # noqa: E402

RECIPE = {
    "rollout.prompts_per_iteration": 32,
    "rollout.n_samples": 4,
    "rollout.max_new_tokens": 8,
    "rollout.temperature": 1.0,
    "train.actor_lr": 5e-4,
    "train.critic_lr": 5e-4,
    "train.warmup_steps": 2,
    "train.lr_schedule": "cosine",
    "train.train_batch_size": 64,
    "train.micro_batch_size": 32,
    "train.ppo_epochs": 2,
    "algo.kl_coef": 0.001,
}


def build_config(algo: str, engine: str, work: Path, iterations: int, overrides: list[str]):
    from engines.toy.model import ensure_tiny_llama
    from engines.toy.task import ensure_digits_dataset
    from ppoflow.config import load_config

    model_dir = ensure_tiny_llama(work / "tiny-llama", seed=0)
    data_dir = ensure_digits_dataset(work / "digits", num_rows=512, seed=0)
    settings = [f"{k}={v}" for k, v in RECIPE.items()]
    settings += [
        f"algo.name={algo}",
        f"rollout.engine={engine}",
        f"model.policy_path={model_dir}",
        f"data.path={data_dir}",
        f"run.iterations={iterations}",
        "data.data_source_key=data_source",
    ]
    return load_config(None, settings + overrides)


def run(
    algo: str,
    engine: str,
    iterations: int,
    seconds: float,
    overrides: list[str],
    work_dir: str | None = None,
    emit_summary: bool = True,
) -> dict:
    """Train until `iterations` or `seconds` run out; returns the summary figures."""
    from stages.loop import EngineLoop

    work = Path(work_dir or tempfile.mkdtemp(prefix="ppoflow-bench-learning-"))
    cfg = build_config(algo, engine, work, iterations, overrides)
    start = time.perf_counter()
    loop = EngineLoop(cfg, work_dir=str(work / "loop"))
    setup_s = time.perf_counter() - start
    rewards, reached, curve, flat_trained = [], None, [], []
    try:
        for it in range(iterations):
            metrics = loop.run_iteration(it)
            elapsed = time.perf_counter() - start
            # with dynamic sampling, reward/mean covers only the kept groups: take the iteration's own prompts
            reward = metrics.get("rollout/first_round_reward_mean", metrics["reward/mean"])
            rewards.append(reward)
            curve.append((elapsed, reward))
            if "rollout/zero_variance_trained_fraction" in metrics:
                flat_trained.append((it, metrics["rollout/zero_variance_trained_fraction"], reward))
            if reached is None and reward >= 0.9:
                reached = round(elapsed, 1)
            print(
                json.dumps(
                    {
                        "iteration": it,
                        "elapsed_s": round(elapsed, 1),
                        **{k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)},
                    }
                ),
                flush=True,
            )
            if elapsed > seconds:
                break
    finally:
        loop.shutdown()
        if work_dir is None:  # a temp folder of our own: model, data and syncs are not wanted afterwards
            shutil.rmtree(work, ignore_errors=True)
    figures = {
        "algo": algo,
        "engine": loop.engine.name,
        "dynamic_sampling": cfg.rollout.dynamic_sampling.enabled,
        "first_reward": round(rewards[0], 4),
        "final_reward": round(rewards[-1], 4),
        "iterations": len(rewards),
        "seconds": round(time.perf_counter() - start, 1),
        "setup_seconds": round(setup_s, 1),
        "reached_0.9_at_s": reached,
        # the reward of the last iteration finished by each wall time (setup included): runs compare at equal time
        # (only times the run lasted); on a shared machine the time axis is noisy, so also per iteration
        "reward_at_s": {
            str(t): round([v for e, v in curve if e <= t][-1], 4)
            for t in (10, 20, 30, 45, 60)
            if curve[0][0] <= t <= curve[-1][0]
        },
        "reward_at_iteration": {str(i): round(rewards[i], 4) for i in (10, 20, 30, 40, 60) if i < len(rewards)},
        **flat_groups_trained(flat_trained),
        "baseline": "iteration 0 (random-init policy)",
    }
    return emit("learning", figures) if emit_summary else figures


def flat_groups_trained(per_iteration: list[tuple[int, float, float]]) -> dict:
    """Dynamic sampling's `rollout/zero_variance_trained_fraction` (share of the trained groups whose samples all
    scored the same: no advantage under a group estimator) over the run, from (iteration, fraction, reward) per
    iteration: mean, worst, and the first iteration above 0 with its reward. It stays 0 while the rounds find
    enough groups with variance; once the task is solved they run out and the first step is topped up
    (engines/ppo/dynamic_sampling.select_groups). Empty without dynamic sampling (the metric is absent)."""
    if not per_iteration:
        return {}
    fractions = [f for _, f, _ in per_iteration]
    first = next(((it, r) for it, f, r in per_iteration if f > 0), None)
    return {
        "zero_variance_trained_fraction_mean": round(sum(fractions) / len(fractions), 4),
        "zero_variance_trained_fraction_max": round(max(fractions), 4),
        "zero_variance_trained_first_iteration": first and first[0],
        "zero_variance_trained_first_reward": first and round(first[1], 4),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algo", default="ppo", choices=ALGO_NAMES)
    p.add_argument("--engine", default="hf", choices=["hf", "vllm", "auto"])
    p.add_argument("--iterations", type=int, default=120, help="also the LR schedule's length")
    p.add_argument("--seconds", type=float, default=600.0, help="stop after this much wall time")
    p.add_argument("--work-dir", default=None, help="where the model, data and policy syncs go (default: temp)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    p.add_argument("--dynamic-sampling", action="store_true", help="rollout.dynamic_sampling.enabled=true")
    a = p.parse_args(argv)
    overrides = a.overrides + ["rollout.dynamic_sampling.enabled=true"] * a.dynamic_sampling
    run(a.algo, a.engine, a.iterations, a.seconds, overrides, a.work_dir)


if __name__ == "__main__":
    sys.exit(main())
