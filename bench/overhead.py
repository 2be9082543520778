"""Pipeline overhead: the same PPO iterations through the full pipeline (Prefect flows and tasks, Arrow
shards, checkpoints on local storage) and through the engines in a bare loop (no Prefect, no storage).

    python -m bench.overhead [--iterations 5] [--rounds 1]

Each variant runs in its own fresh process (engines built from scratch in both), in alternating order
(pipeline, bare, pipeline, bare, ...). Per-iteration time is the mean wall time between the ends of
consecutive iterations, so the first iteration (engine start-up, DeepSpeed set-up) is excluded on both
sides. Same config, same seed, same tiny model and digits task; HF generate on both sides.
Baseline: the bare engine loop. Figure: ratio = pipeline / bare per-iteration time (goal <= 1.05).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit

REPO = Path(__file__).resolve().parent.parent


def bench_config(workdir: str, run: str, iterations: int):
    from engines.toy.model import ensure_tiny_llama
    from engines.toy.task import ensure_digits_dataset
    from ppoflow.config import build_config

    model = ensure_tiny_llama(os.path.join(workdir, "model"))
    data = ensure_digits_dataset(os.path.join(workdir, "data"))
    return build_config({
        "run": {"name": run, "root": os.path.join(workdir, "runs"), "iterations": iterations, "seed": 0},
        "model": {"policy_path": str(model)}, "data": {"path": str(data)},
        "rollout": {"engine": "hf", "prompts_per_iteration": 32, "n_samples": 4, "max_new_tokens": 8},
        "algo": {"name": "ppo"}, "train": {"micro_batch_size": 32, "ppo_epochs": 2, "actor_lr": 2e-3,
                                           "critic_lr": 2e-3},
        "score": {"cache": False},  # the bare loop has no cache; keep the work identical
        "pipeline": {"retries": 0},
    }, "bench.overhead")


def worker(variant: str, workdir: str, iterations: int) -> None:
    """Run one variant in this process; print {"ends": [...]} (unix time at the end of each iteration)."""
    cfg = bench_config(workdir, f"overhead-{variant}-{os.getpid()}", iterations)
    ends: list[float] = []
    if variant == "pipeline":
        from flows.training import ppo_training
        result = ppo_training(cfg.model_dump(mode="json"))
        ends = [row["time/finished_unix"] for row in result["iterations"]]
        rewards = [row["reward/mean"] for row in result["iterations"]]
    else:
        from engines.loop import EngineLoop
        loop = EngineLoop(cfg)
        rewards = []
        for i in range(1, iterations + 1):
            rewards.append(loop.run_iteration(i)["reward/mean"])
            ends.append(time.time())
    print(json.dumps({"variant": variant, "ends": ends, "rewards": rewards}), flush=True)


def run_variant(variant: str, workdir: str, iterations: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "DS_ACCELERATOR": "cpu",
           "PREFECT_HOME": os.path.join(workdir, "prefect-home"), "PYTHONUNBUFFERED": "1",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    env.pop("PREFECT_API_URL", None)  # the embedded default: Prefect's local ephemeral server
    out = subprocess.run([sys.executable, "-m", "bench.overhead", "--worker", variant, "--workdir", workdir,
                          "--iterations", str(iterations)], cwd=REPO, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{\"variant\"")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} worker failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    data = json.loads(lines[-1])
    ends = data["ends"]
    data["per_iteration_s"] = (ends[-1] - ends[0]) / (len(ends) - 1)
    return data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--worker", choices=["pipeline", "bare"])
    p.add_argument("--workdir")
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.workdir, a.iterations)
        return
    if a.iterations < 2:
        raise SystemExit("--iterations must be >= 2 (the first iteration is excluded)")
    times: dict[str, list[float]] = {"pipeline": [], "bare": []}
    rewards: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="ppoflow-overhead-") as workdir:
        for _ in range(a.rounds):
            for variant in ("pipeline", "bare"):
                data = run_variant(variant, workdir, a.iterations)
                times[variant].append(data["per_iteration_s"])
                rewards[variant] = data["rewards"]
    pipeline, bare = statistics.median(times["pipeline"]), statistics.median(times["bare"])
    emit("overhead", {"baseline": "bare engine loop (no Prefect, no storage)", "iterations": a.iterations,
                      "rounds": a.rounds, "pipeline_s_per_iter": round(pipeline, 3),
                      "bare_s_per_iter": round(bare, 3), "ratio": round(pipeline / bare, 3),
                      "goal": "<= 1.05", "rewards_pipeline": rewards["pipeline"], "rewards_bare": rewards["bare"]})


if __name__ == "__main__":
    main()
