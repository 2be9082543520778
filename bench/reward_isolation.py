"""What running a reward function in a worker process costs against running it in a worker thread.

Run from the repository root:

    python -m bench.reward_isolation                 # 512 samples, 5 repeats
    python -m bench.reward_isolation --samples 2048 --repeats 7

Workload: the digits task's rewards (engines/toy/task.py) on 512 made-up samples (128 prompts x 4
responses of 1-16 random words), in both contracts: veRL's `compute_score` (one call per sample, so one
round trip to the worker per sample: the worst case for a process) and OpenRLHF's `reward_func` (one call
per `batch_size` = 64 samples).

Variants (seconds = median over --repeats of `FunctionRewardSource.score(batch)`, after one untimed call
that also starts the worker):
- thread (the named baseline): `isolation: thread`, the default;
- process: `isolation: process` (engines/rewards/isolated.py): arguments and results pickled over pipes.

Figures per contract: thread_s, process_s, ratio = process_s / thread_s, overhead_us_per_call =
(process_s - thread_s) / calls; worker_start_s = the first call's extra time (interpreter start and
imports, once per process). Check (fails the run): both variants give the same rewards.
Ends with one JSON line via bench.common.emit (appended to bench/results/reward_isolation.jsonl).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import emit

WORDS = [str(d) for d in range(10)] + ["w3", "w4", "w5", "please", "now"]
CONTRACTS = {"verl": "engines.toy.task:compute_score", "openrlhf": "engines.toy.task:reward_func"}


def digits_batch(samples: int, seed: int = 0):
    """A RewardBatch of digits prompts x 4 responses of 1-16 random words (text only: rewards need no ids)."""
    from engines.rewards.base import RewardBatch
    from engines.toy.task import make_rows

    rows, rng = make_rows(max(1, samples // 4), seed), random.Random(seed)
    prompts, responses, labels = [], [], []
    for prompt, label in zip(rows["prompt"], rows["label"]):
        for _ in range(4):
            prompts.append(prompt)
            responses.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 16))))
            labels.append(label)
    n = len(prompts)
    return RewardBatch(
        prompts=prompts,
        responses=responses,
        prompt_ids=[[]] * n,
        response_ids=[[]] * n,
        labels=labels,
        data_sources=["digits"] * n,
        sample_ids=[f"sample {i}" for i in range(n)],
    )


def time_source(source, batch, repeats: int) -> tuple[float, float, list[float]]:
    """(first call s, median s of `repeats` later calls, rewards)."""
    started = time.perf_counter()
    rewards = source.score(batch)
    first = time.perf_counter() - started
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        again = source.score(batch)
        times.append(time.perf_counter() - started)
        if again != rewards:
            raise SystemExit(f"{source.spec} ({source.isolation}) gave different rewards on a repeat")
    return first, statistics.median(times), rewards


def main(argv: list[str] | None = None) -> dict:
    from engines.rewards.function import FunctionRewardSource

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    batch = digits_batch(args.samples)
    figures: dict = {
        "baseline": "isolation: thread (a worker thread of the scoring process)",
        "samples": len(batch),
        "repeats": args.repeats,
        "contracts": {},
    }
    for contract, spec in CONTRACTS.items():
        results = {}
        for isolation in ("thread", "process"):
            source = FunctionRewardSource(spec, batch_size=64, isolation=isolation)
            results[isolation] = time_source(source, batch, args.repeats)
            source.close()
        (t_first, t_s, t_rewards), (p_first, p_s, p_rewards) = results["thread"], results["process"]
        if p_rewards != t_rewards:
            raise SystemExit(f"{contract}: the process gave other rewards than the thread")
        calls = len(batch) if contract == "verl" else -(-len(batch) // 64)
        figures["contracts"][contract] = {
            "calls": calls,
            "thread_s": round(t_s, 5),
            "process_s": round(p_s, 5),
            "ratio": round(p_s / t_s, 2),
            "overhead_us_per_call": round(1e6 * (p_s - t_s) / calls, 1),
            "worker_start_s": round(max(0.0, (p_first - p_s) - (t_first - t_s)), 3),
        }
    figures["verl_ratio"] = figures["contracts"]["verl"]["ratio"]
    figures["openrlhf_ratio"] = figures["contracts"]["openrlhf"]["ratio"]
    return emit("reward_isolation", figures)


if __name__ == "__main__":
    main()
