"""Each stage of a steady iteration of the README recipe against its compute bound (its FLOPs at the matmul peak).

    python -m bench.roofline                              # SmolLM2-135M, configs/real_arithmetic.yaml, 3 iterations
    python -m bench.roofline --iterations 2 --set rollout.prompts_per_iteration=4 --results-dir /tmp/smoke

What runs: `ppoflow train configs/real_arithmetic.yaml` (no eval, no held-out rows) for --iterations into a temporary
root, as bench.real_model's pipeline part runs it, so the seconds are the ones a user meets. Then, on the last
iteration's own shards, each stage's FLOPs (bench/roofline_flops.py states the model and how it is tested):
  rollout  modelled from the rollout shard's token counts (vLLM runs outside this process);
  score    counted: stages.score.score_rows with the run's Scorer over the rollout shard, under torch's counter;
  update   counted: stages.update.train_on with a trainer built at the iteration's starting checkpoint, over the
           scored shard (the same micro-batches, padding, shared prompts and passes the stage ran);
  checkpoint: no FLOPs (writes and hashes).
Two stages' seconds are also split, by their own timing/<stage>_<part> (SPLITS):
  rollout  `sample_s` is the engine's sampling (vLLM's prefill and decode steps), whose ratio to the rollout's bound
           (`sample_ratio`) is its compute efficiency; `serve_s` makes the engine serve the iteration's policy (the
           weights loaded into it, attested); the rest of the stage writes the shards;
  update   `train_s` is the PPO update (`train_ratio` likewise); `save_s` writes and hashes the staged checkpoint
           (weights and optimizer state); the rest of the stage reads the shards and writes the experience.

Bound: FLOPs / peak, where peak = the best float32 torch.mm GFLOP/s on the model's own shapes (one micro-batch's
tokens x the MLP, attention-projection and LM-head widths) at this process's thread count, measured in the same run
once the pipeline has ended. `ratio` = measured seconds / bound seconds: 1.0 is every FLOP at the matmul peak. The
iteration: the stages' FLOPs summed, against its wall seconds (between the ends of consecutive iterations; the
first: from the command's start, start-up included); `outside_s` = that minus the stages' timing/* (orchestration,
start-up, waits between stages). Seconds are the steady state (the median of iterations 2..N of
timing/*), beside the first iteration's; FLOPs are the last iteration's. Goal (issue 55): the steady iteration at
<= 1.25x its bound. Ends with one JSON line, appended to bench/results/roofline.jsonl (or --results-dir).

Where a stage's time goes (score and update, the stages that compute in this process): the same pass once more under
torch.profiler (bench/kernel_shares.py's CPU classes), the update with a trainer built again at the iteration's
starting checkpoint. `matmul_s` is the seconds its matmul operators took, `matmul_gflops` the stage's FLOPs over
them (the rate its matrix multiplies ran at on their own shapes; attention's few FLOPs counted in) and
`matmul_floor_ratio` = matmul_s / bound_s: the ratio the stage would have if nothing but its matmuls took any time.
`profiled_s` is that pass's wall seconds (the profiler's own cost included), so the rest of it,
profiled_s - matmul_s, is everything else: element-wise work, the optimizer, Python.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Optional

from bench.common import emit
from bench.real_model import RECIPE, matmul_gflops, run_train, stage_seconds
from bench.roofline_flops import Dims, counted_flops, rollout_flops

STAGES = ("rollout", "score", "update", "checkpoint")
# {stage: (the part that computes, the rest)}: the stage's own timing/<stage>_<part> seconds
SPLITS = {"rollout": ("sample", "serve"), "update": ("train", "save")}
GOAL = 1.25


def rollout_groups(rollout) -> list[tuple[int, list[int]]]:
    """(prompt tokens, [response tokens of each sample]) per group of a rollout table, in group order."""
    from stages.tables import group_ids_of

    prompts, responses = rollout.column("prompt_ids").to_pylist(), rollout.column("response_ids").to_pylist()
    groups: dict[int, tuple[int, list[int]]] = {}
    for row, group in enumerate(group_ids_of(rollout.column("sample_index").to_pylist())):
        groups.setdefault(group, (len(prompts[row]), []))[1].append(len(responses[row]))
    return [groups[g] for g in sorted(groups)]


def iteration_inputs(cfg, iteration: int):
    """(rollout table, scored table, the policy folder the update started from) of `iteration` of the run."""
    from storage.fs import join
    from storage.layout import layout_for
    from storage.shards import read_shards

    layout = layout_for(cfg)
    rollout = read_shards(layout.fs, layout.stage_dir(iteration, "rollout"))
    scored = read_shards(layout.fs, layout.stage_dir(iteration, "scored"))
    start = cfg.model.policy_path if iteration == 1 else join(layout.checkpoint_dir(iteration - 1), "policy")
    return rollout, scored, start


def stage_flops(cfg, iteration: int) -> tuple[dict[str, int], Dims, int]:
    """({stage: FLOPs} of `iteration`, the policy's Dims, the mean tokens per row) from the run's own shards."""
    from engines.scoring.scorer import Scorer
    from engines.trainer.ppo_trainer import PPOTrainer
    from stages.score import score_rows
    from stages.update import train_on

    rollout, scored, start = iteration_inputs(cfg, iteration)
    dims = Dims.from_model_dir(cfg.model.policy_path)
    flops = {"rollout": rollout_flops(dims, rollout_groups(rollout)), "checkpoint": 0}
    _, flops["score"] = counted_flops(lambda: score_rows(Scorer(cfg), rollout, None))
    trainer = PPOTrainer(cfg, start)
    _, flops["update"] = counted_flops(lambda: train_on(trainer, scored))
    lengths = [len(p) + len(r) for p, r in zip(rollout["prompt_ids"].to_pylist(), rollout["response_ids"].to_pylist())]
    return flops, dims, round(sum(lengths) / len(lengths))


def matmul_split(run) -> dict[str, float]:
    """{"matmul_s": seconds of run()'s matmul operators, "profiled_s": run()'s wall seconds}, from one call under
    torch.profiler on CPU (bench/kernel_shares.py: aten::mm, addmm, bmm, matmul, linear are matmuls)."""
    from bench.kernel_shares import profile_shares

    shares = profile_shares(run, "cpu")
    return {"matmul_s": shares["profiled_s"] * shares["matmul_share"], "profiled_s": shares["wall_s"]}


def stage_matmuls(cfg, iteration: int) -> dict[str, dict[str, float]]:
    """{"score" | "update": matmul_split of that stage's pass over `iteration`'s own shards}: a warm scorer's second
    pass, and train_on with a trainer built at the iteration's starting checkpoint (as stage_flops runs them)."""
    from engines.scoring.scorer import Scorer
    from engines.trainer.ppo_trainer import PPOTrainer
    from stages.score import score_rows
    from stages.update import train_on

    rollout, scored, start = iteration_inputs(cfg, iteration)
    scorer = Scorer(cfg)
    score_rows(scorer, rollout, None)  # the pipeline's scorer is warm after iteration 1: fault its pages in first
    out = {"score": matmul_split(lambda: score_rows(scorer, rollout, None))}
    scorer = None  # its model's memory back before the trainer is built
    trainer = PPOTrainer(cfg, start)
    out["update"] = matmul_split(lambda: train_on(trainer, scored))
    return out


def peak_gflops(dims: Dims, micro_batch_tokens: int) -> dict[str, float]:
    """Best float32 GFLOP/s of torch.mm on the model's shapes, one micro-batch of tokens as the rows. Best of 10
    windows: measured right after the pipeline ends, a window can still share the cores with its processes' exit (a
    run at 6b41767 read 137 GFLOP/s on the MLP shape where the next read 179)."""
    shapes = {
        "mlp": (dims.hidden, dims.intermediate),
        "attn": (dims.hidden, dims.heads * dims.head_dim),
        "head": (dims.hidden, dims.vocab),
    }
    return {name: round(matmul_gflops(micro_batch_tokens, k, n, windows=10), 1) for name, (k, n) in shapes.items()}


def iteration_walls(rows: list[dict], started: float) -> tuple[float, float]:
    """(wall seconds from the command's start to the end of iteration 1, the median wall seconds between the ends
    of consecutive later iterations), from the rows' time/finished_unix. timing/iteration is the sum of the
    stages' seconds, so it cannot show the time between them; the wall clock does."""
    ends = sorted((r["iteration"], r["time/finished_unix"]) for r in rows if r.get("iteration", 0) >= 1)
    gaps = [b[1] - a[1] for a, b in zip(ends, ends[1:])]
    return ends[0][1] - started, statistics.median(gaps)


def roofline(
    flops: dict[str, int],
    seconds: dict[str, float],
    wall: float,
    peak: float,
    matmuls: Optional[dict[str, dict[str, float]]] = None,
) -> dict:
    """Per stage and for the iteration: FLOPs, bound seconds at `peak` GFLOP/s, measured seconds and their ratio.
    `wall`: the iteration's wall seconds (iteration_walls), against which the whole iteration is measured.
    `matmuls`: {stage: matmul_split} for the stages profiled (stage_matmuls); adds their matmul figures."""
    out: dict = {}
    for stage in STAGES:
        bound = flops[stage] / (peak * 1e9)
        measured = seconds.get(f"timing/{stage}")
        out[stage] = {
            "gflop": round(flops[stage] / 1e9, 2),
            "bound_s": round(bound, 3),
            "measured_s": round(measured, 3) if measured is not None else None,
            "ratio": round(measured / bound, 2) if measured is not None and bound > 0 else None,
        }
        split = (matmuls or {}).get(stage)
        if split is not None and split["matmul_s"] > 0 and bound > 0:
            out[stage]["profiled_s"] = round(split["profiled_s"], 3)
            out[stage]["matmul_s"] = round(split["matmul_s"], 3)
            out[stage]["matmul_gflops"] = round(flops[stage] / 1e9 / split["matmul_s"], 1)
            out[stage]["matmul_floor_ratio"] = round(split["matmul_s"] / bound, 2)
    for stage, (compute, rest) in SPLITS.items():  # inside a stage: the part that computes, and the rest
        part_s = {part: seconds.get(f"timing/{stage}_{part}") for part in (compute, rest)}
        if part_s[compute] is not None and flops[stage] > 0:
            out[stage][f"{compute}_s"] = round(part_s[compute], 3)
            out[stage][f"{compute}_ratio"] = round(part_s[compute] / (flops[stage] / (peak * 1e9)), 2)
        if part_s[rest] is not None:
            out[stage][f"{rest}_s"] = round(part_s[rest], 3)
    total = sum(flops.values())
    staged = sum(seconds.get(f"timing/{s}", 0.0) for s in STAGES)
    out["iteration"] = {
        "gflop": round(total / 1e9, 2),
        "bound_s": round(total / (peak * 1e9), 3),
        "measured_s": round(wall, 3),
        "ratio": round(wall / (total / (peak * 1e9)), 2),
        "outside_s": round(wall - staged, 3),  # orchestration, start-up in the first, waits between stages
    }
    return out


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=3, help="pipeline iterations (>= 2: one steady)")
    p.add_argument("--set", action="append", default=[], help="extra config override for the recipe")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--results-dir", default=None)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
    from bench.real_model import recipe
    from ppoflow.config import load_config

    a = parse(argv)
    if a.iterations < 2:
        raise SystemExit("--iterations must be >= 2: the first iteration is start-up, the rest are steady")
    root = Path(tempfile.mkdtemp(prefix="ppoflow-bench-roofline-"))
    try:
        recipe(root, a.set)  # fetches the model and generates the data, as `make demo-real` does
        sets = [f"run.root={root}", f"run.iterations={a.iterations}", "eval.before_training=false"]
        sets += ["data.reasoning_gym.eval_size=0", *a.set]
        rows, started, _ = run_train(root, sets, dict(os.environ), a.timeout_s)
        cfg = load_config(root / load_config(RECIPE, sets).run.name / "config.yaml")
        flops, dims, row_tokens = stage_flops(cfg, a.iterations)
        matmuls = stage_matmuls(cfg, a.iterations)
        first, steady = stage_seconds(rows)
        first_wall, steady_wall = iteration_walls(rows, started)
        peaks = peak_gflops(dims, cfg.train.micro_batch_size * row_tokens)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    peak = max(peaks.values())
    figures = {
        "recipe": str(RECIPE.relative_to(RECIPE.parents[1])),
        "sets": a.set,
        "iterations": a.iterations,
        "baseline": "the matmul peak: each stage's FLOPs at the best float32 torch.mm GFLOP/s on the model's shapes",
        "peak_gflops": peaks,
        "steady": roofline(flops, steady, steady_wall, peak, matmuls),
        "first": roofline(flops, first, first_wall, peak),
        "goal_iteration_ratio": GOAL,
    }
    return emit("roofline", figures, Path(a.results_dir) if a.results_dir else None)


if __name__ == "__main__":
    main()
