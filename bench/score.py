"""Score-stage throughput: a cold against a warm prompt-hash cache, and batched against one-sample-at-a-time.

Run from the repository root:

    python -m bench.score                      # 512 rows (128 digits prompts x 4 samples), 3 repeats
    python -m bench.score --prompts 256 --repeats 5 --threads 2

Workload: rollout rows of the digits task (engines/toy/task.py) made here, as the rollout stage writes them
(prompt ids with BOS, response text decoded from the response ids; responses of 1-16 random digit/filler
words, so lengths differ and batches need padding). The scorer is the real Scorer: the tiny Llama
(engines/toy/model.py) as reference (log-probs of every response token), plus two reward sources, the tiny
reward model (engines/toy/reward_model.py, sequence classification) and the digits function
(`engines.toy.task:reward_func`, OpenRLHF's contract). Models are built once and warm before timing;
model loading is not part of any figure.

Variants (rows/s = rows / median seconds over --repeats, after one untimed warm-up pass):
- per_sample (the named baseline): `scorer.score([row])` for each row in turn: one reward-model forward,
  one function call and one reference forward per sample, as OpenRLHF's reward calls do (its remote
  reward model and reward functions are called per sample during generation).
- per_sample_rewards (a second, milder baseline, reported without a goal): each reward source called one
  sample at a time, the reference still in micro-batches: OpenRLHF's split exactly (its reference model
  scores batches; issue 6 and OpenRLHF #450 / #1123 describe the per-sample reward calls).
- batched: `score_with_cache(scorer, rows, cache=None)`: one call per source per `batch_size` rows
  (reward model: rows sorted by length, right-padded) and the reference in micro-batches; no cache.
- cold: `score_with_cache` with a ScoreCache on a new, empty local folder: everything is computed as in
  `batched`, then written as one cache segment (the first attempt of a score stage).
- warm: `score_with_cache` with a NEW ScoreCache on the cold run's folder, so entries are read back from
  storage as a retried stage in a fresh process would: keys hashed, one segment read, no model called.

Ratios: warm_over_cold = cold s / warm s (goal >= 20); batched_over_per_sample = per_sample s / batched s
(goal >= 5). Checks (they fail the run): warm results equal cold results exactly; batched rewards and
reference log-probs equal per-sample ones within 1e-4 (float32 rounding of other matmul shapes).
Ends with one JSON line via bench.common.emit (appended to bench/results/score.jsonl).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

WORDS = [str(d) for d in range(10)] + ["w3", "w4", "w5", "please", "now"]
GOALS = {"warm_over_cold": 20.0, "batched_over_per_sample": 5.0}


def digits_rollout_inputs(tokenizer, num_prompts: int, n_samples: int, seed: int) -> list:
    """ScoringInputs for `num_prompts` digits prompts x `n_samples` responses of 1-16 random words."""
    from engines.scoring.scorer import ScoringInput
    from engines.toy.task import make_rows

    rows, rng = make_rows(num_prompts, seed), random.Random(seed)
    inputs = []
    for prompt_index, (prompt, label) in enumerate(zip(rows["prompt"], rows["label"])):
        prompt_ids = tokenizer(prompt)["input_ids"]
        for sample_index in range(n_samples):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 16)))
            response_ids = tokenizer(words, add_special_tokens=False)["input_ids"]
            inputs.append(
                ScoringInput(
                    prompt=prompt,
                    response=tokenizer.decode(response_ids, skip_special_tokens=True),
                    prompt_ids=prompt_ids,
                    response_ids=response_ids,
                    label=label,
                    data_source="digits",
                    sample_id=f"prompt {prompt_index} sample {sample_index}",
                )
            )
    return inputs


def build_scorer(workdir: Path, micro_batch_size: int):
    """The Scorer over freshly built tiny models in `workdir` (reference + reward model + digits function)."""
    from engines.scoring.scorer import Scorer
    from engines.toy.model import build_tiny_llama
    from engines.toy.reward_model import build_tiny_reward_model
    from ppoflow.config import build_config

    policy = build_tiny_llama(workdir / "tiny-llama", seed=0)
    reward_model = build_tiny_reward_model(workdir / "tiny-rm", seed=0)
    cfg = build_config(
        {
            "model": {"policy_path": str(policy)},
            "train": {"micro_batch_size": micro_batch_size},
            "reward": {
                "sources": [
                    {"kind": "model", "target": str(reward_model), "name": "rm", "weight": 0.1, "batch_size": 64},
                    {"kind": "function", "target": "engines.toy.task:reward_func", "name": "digits", "weight": 1.0},
                ]
            },
        },
        "bench.score",
    )
    return Scorer(cfg)


def timed(fn, repeats: int) -> tuple[float, object]:
    """(median seconds, last result) of `repeats` calls of fn()."""
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def rewards_per_sample(scorer, inputs: list) -> list:
    """Every reward source called with one sample at a time, the reference batched; raw outputs only."""
    from engines.rewards.base import RewardBatch

    rewards = [
        [
            source.score(
                RewardBatch(
                    [x.prompt],
                    [x.response],
                    [x.prompt_ids],
                    [x.response_ids],
                    [x.label],
                    [x.data_source],
                    [x.sample_id],
                )
            )[0]
            for source in scorer.sources
        ]
        for x in inputs
    ]
    return [rewards, scorer.reference.logprobs([x.prompt_ids for x in inputs], [x.response_ids for x in inputs])]


def run_variants(scorer, inputs: list, cache_root: Path, repeats: int) -> tuple[dict, dict]:
    """({variant: median seconds}, {variant: results}) for per_sample, batched, cold and warm."""
    import fsspec

    from engines.scoring.cached import score_with_cache
    from storage.score_cache import ScoreCache

    fs = fsspec.filesystem("file")
    folders = iter(str(cache_root / f"cold-{i}") for i in range(repeats))
    seconds, results = {}, {}
    seconds["per_sample"], results["per_sample"] = timed(lambda: [scorer.score([x])[0] for x in inputs], repeats)
    seconds["per_sample_rewards"], _ = timed(lambda: rewards_per_sample(scorer, inputs), repeats)
    seconds["batched"], (results["batched"], _) = timed(lambda: score_with_cache(scorer, inputs, None), repeats)
    seconds["cold"], (results["cold"], cold_stats) = timed(
        lambda: score_with_cache(scorer, inputs, ScoreCache(fs, next(folders))), repeats
    )
    filled = str(cache_root / f"cold-{repeats - 1}")
    seconds["warm"], (results["warm"], warm_stats) = timed(
        lambda: score_with_cache(scorer, inputs, ScoreCache(fs, filled)), repeats
    )
    if cold_stats.hits != 0 or warm_stats.hits != len(inputs) or warm_stats.computed != 0:
        raise AssertionError(
            f"cold run had {cold_stats.hits} hits, warm run {warm_stats.hits} of {len(inputs)} "
            f"with {warm_stats.computed} computed: the variants did not run as described"
        )
    return seconds, results


def check_results(results: dict) -> float:
    """Raise unless warm == cold exactly and batched ~= per-sample; returns the largest batched difference."""
    if results["warm"] != results["cold"]:
        raise AssertionError("warm-cache results differ from the cold run's")
    worst = 0.0
    for batched, alone in zip(results["batched"], results["per_sample"]):
        worst = max(
            [worst, abs(batched.reward - alone.reward)]
            + [abs(a - b) for a, b in zip(batched.ref_logprobs, alone.ref_logprobs)]
        )
    if worst > 1e-4:
        raise AssertionError(f"batched and per-sample scores differ by {worst:.3g} (> 1e-4)")
    return worst


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=128, help="digits prompts (rows = prompts x samples)")
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported)")
    parser.add_argument("--micro-batch", type=int, default=64, help="reference rows per forward when batched")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a shared box fair)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from bench.common import emit
    from engines.toy.model import build_tokenizer

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-score-") as tmp:
        workdir = Path(tmp)
        scorer = build_scorer(workdir, args.micro_batch)
        inputs = digits_rollout_inputs(build_tokenizer(), args.prompts, args.samples, args.seed)
        scorer.score(inputs)  # warm-up: first forwards allocate and pick kernels
        seconds, results = run_variants(scorer, inputs, workdir / "cache", args.repeats)
    worst = check_results(results)
    rows = len(inputs)
    rows_per_s = {name: round(rows / s, 1) for name, s in seconds.items()}
    ratios = {
        "warm_over_cold": round(seconds["cold"] / seconds["warm"], 1),
        "batched_over_per_sample": round(seconds["per_sample"] / seconds["batched"], 1),
        "batched_over_per_sample_rewards": round(seconds["per_sample_rewards"] / seconds["batched"], 1),
    }
    print(
        f"{rows} rows, {len({(tuple(x.prompt_ids), tuple(x.response_ids)) for x in inputs})} distinct pairs, "
        f"{args.threads} thread(s), median of {args.repeats}"
    )
    for name in ("per_sample", "per_sample_rewards", "batched", "cold", "warm"):
        print(f"  {name:<18} {seconds[name]:8.3f} s  {rows_per_s[name]:>10.1f} rows/s")
    for name, value in ratios.items():
        goal = "no goal"
        if name in GOALS:
            goal = f"goal >= {GOALS[name]:g}x: {'met' if value >= GOALS[name] else 'NOT met'}"
        print(f"  {name:<31} {value:7.1f}x  ({goal})")
    return emit(
        "score",
        {
            "rows": rows,
            "threads": args.threads,
            "repeats": args.repeats,
            "micro_batch": args.micro_batch,
            "seconds": {k: round(v, 4) for k, v in seconds.items()},
            "rows_per_s": rows_per_s,
            **ratios,
            "goals": GOALS,
            "batched_vs_per_sample_max_abs_diff": worst,
        },
    )


if __name__ == "__main__":
    main()
