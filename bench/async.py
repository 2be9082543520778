"""Pipelined iterations: iterations per second and reward against wall time for max_staleness k = 0, 1, 2.

    python -m bench.async [--iterations 16] [--repeats 1] [--modes warm,inprocess]

One loopback Prefect server (`prefect server start`, SQLite) serves every variant. The same config runs
with pipeline.max_staleness k = 0 (the baseline: one iteration after another), 1 and 2, in two modes:
- warm: three `ppoflow worker` processes (rollout; score; update), started with the driver, run the stages
  (bench/processes.py's WARM_GROUPS; the checkpoint commit runs in the flow): separate pools, here one core each;
- inprocess: every stage in the driver process, pipelined iterations in threads of Prefect's task runner.
Each variant starts fresh processes (driver, and workers for warm); the order of the variants alternates
between repeats (k = 0, 1, 2, then 2, 1, 0, ...). Every process runs with OMP_NUM_THREADS=1 (--threads):
on the 2-core machine a stage gets one core, as a pool gets its own GPUs, so what k buys is the overlap of
the rollout/score pool with the trainer, not more threads per op.

Workload: the toy digits task, tiny Llama, HF generate, sized so rollout+score and update+checkpoint take
similar time (WORKLOAD below; the per-stage body seconds are reported to show it).

Figures per mode and k (medians over repeats):
- startup_s: start of the processes to the end of iteration 1 (imports, worker start, engine builds).
- total_s: start to the end of the last iteration (what a user waits for the whole run).
- it_per_s: steady state, iterations 2..N: (N-1) / (end of N - end of 1).
- speedup: it_per_s / it_per_s of k = 0 in the same mode (goal for warm k = 1: >= 1.5);
  total_speedup: the same on total_s.
- reward_at_equal_time: per repeat, at T = the shortest total_s among that repeat's variants, the mean
  reward/mean of the last 3 iterations each variant had finished by T; the median over repeats (goal: k = 1
  >= k = 0), and per repeat in reward_at_equal_time_by_seed. Repeat r trains with run.seed = r: one
  trajectory of this toy task moves with its seed by more than k changes it (at iteration 40, k = 0 samples
  0.29, 0.16 and 0.12 with seeds 0, 1, 2), so one seed cannot say whether staleness costs reward.
- stage_body_s: median seconds inside each stage body (its stage record), iterations 2..N.
- staleness_ok: every row's async/staleness is min(k, i-1).
Plot: bench/results/async_reward_vs_seconds.png (reward/mean against seconds since start, every variant).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.common import RESULTS_DIR, emit
from bench.overhead import bench_config
from bench.processes import (
    REPO,
    STAGES,
    add_driver_arguments,
    child_env,
    run_driver,
    train_in_driver,
    variant_sections,
    workdir_with_server,
)

KS = (0, 1, 2)
GOAL = 1.5
# HF generate of 48 tokens for 64 x 4 samples and their scoring take about as long as one ZeRO-0 GRPO epoch
# over those 256 rows (no critic)
WORKLOAD = {
    "algo": {"name": "grpo"},
    "rollout": {"engine": "hf", "prompts_per_iteration": 64, "n_samples": 4, "max_new_tokens": 48},
    "train": {"micro_batch_size": 64, "ppo_epochs": 1, "zero_stage": 0},
}


def async_config(workdir: str, run: str, iterations: int, mode: str, k: int, seed: int = 0):
    pipeline = {"max_staleness": k, **variant_sections(mode).get("pipeline", {})}
    return bench_config(workdir, run, iterations, "tiny", extra={**WORKLOAD, "pipeline": pipeline}, seed=seed)


def driver(mode: str, k: int, workdir: str, run: str, iterations: int, seed: int = 0) -> None:
    """Run the training flow in this process; print its metrics rows and stage body seconds as one JSON line."""
    from storage.stage_records import read_stage_record

    keep = ("iteration", "reward/mean", "time/finished_unix", "async/staleness")
    layout, rows = train_in_driver(async_config(workdir, run, iterations, mode, k, seed), keep)
    bodies = {s: [read_stage_record(layout, i, s)["seconds"] for i in range(1, iterations + 1)] for s in STAGES}
    print(json.dumps({"driver": mode, "k": k, "rows": rows, "bodies": bodies}), flush=True)


def run_variant(
    mode: str, k: int, workdir: str, api_url: str, iterations: int, threads: int, tag: str, seed: int = 0
) -> dict:
    env = {**child_env(workdir, api_url), "OMP_NUM_THREADS": str(threads)}
    args = ["--driver", mode, "--k", str(k), "--workdir", workdir, "--run", tag, "--iterations", str(iterations)]
    args += ["--seed", str(seed)]
    return run_driver("bench.async", args, "warm" if mode == "warm" else "inprocess", workdir, env, tag)


def figures_of(run: dict) -> dict:
    rows = run["rows"]
    ends = [row["time/finished_unix"] for row in rows]
    k = run["k"]
    return {
        "startup_s": ends[0] - run["t0"],
        "total_s": ends[-1] - run["t0"],
        "it_per_s": (len(ends) - 1) / (ends[-1] - ends[0]),
        "stage_body_s": {s: statistics.median(run["bodies"][s][1:]) for s in STAGES},
        "staleness_ok": all(row["async/staleness"] == min(k, row["iteration"] - 1) for row in rows),
        "curve": [(round(end - run["t0"], 2), row["reward/mean"]) for end, row in zip(ends, rows)],
    }


def reward_by(curve: list, seconds: float, last: int = 3) -> float | None:
    """Mean reward of the last `last` iterations finished by `seconds` (None when none had finished)."""
    done = [reward for t, reward in curve if t <= seconds]
    return sum(done[-last:]) / len(done[-last:]) if done else None


def summarize(mode: str, runs: dict[int, list[dict]]) -> dict:
    figs = {k: [figures_of(r) for r in rs] for k, rs in runs.items()}
    out: dict = {}
    for k, fs in figs.items():
        out[f"k{k}"] = {
            key: round(statistics.median(f[key] for f in fs), 3) for key in ("startup_s", "total_s", "it_per_s")
        }
        out[f"k{k}"]["stage_body_s"] = {
            s: round(statistics.median(f["stage_body_s"][s] for f in fs), 3) for s in STAGES
        }
        out[f"k{k}"]["staleness_ok"] = all(f["staleness_ok"] for f in fs)
    for k in runs:
        out[f"k{k}"]["speedup"] = round(out[f"k{k}"]["it_per_s"] / out["k0"]["it_per_s"], 3)
        out[f"k{k}"]["total_speedup"] = round(out["k0"]["total_s"] / out[f"k{k}"]["total_s"], 3)
    # per repeat (one seed each): the reward of every k at that repeat's shortest total time
    repeats = range(min(len(fs) for fs in figs.values()))
    equal_times = [min(figs[k][j]["total_s"] for k in figs) for j in repeats]
    for k, fs in figs.items():
        by_seed = [reward_by(fs[j]["curve"], equal_times[j]) for j in repeats]
        out[f"k{k}"]["reward_at_equal_time_by_seed"] = [None if r is None else round(r, 4) for r in by_seed]
        rewards = [r for r in by_seed if r is not None]
        out[f"k{k}"]["reward_at_equal_time"] = round(statistics.median(rewards), 4) if rewards else None
    out["equal_time_s"] = round(statistics.median(equal_times), 2)
    out["curves"] = {f"k{k}": fs[0]["curve"] for k, fs in figs.items()}
    return out


def plot(results: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:  # the dev extra is not installed: the JSON line still has the curves
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, result in results.items():
        for name, curve in result["curves"].items():
            ax.plot([t for t, _ in curve], [r for _, r in curve], marker=".", label=f"{mode} {name}")
    ax.set_xlabel("seconds since start (processes started, first iteration included)")
    ax.set_ylabel("reward/mean")
    ax.set_title("pipelined iterations: reward against wall time")
    ax.legend()
    path = RESULTS_DIR / "async_reward_vs_seconds.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1, help="repeat r trains with run.seed = r")
    p.add_argument("--modes", default="warm,inprocess")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    add_driver_arguments(p, ["warm", "inprocess"])
    p.add_argument("--k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.driver:
        driver(a.driver, a.k, a.workdir, a.run, a.iterations, a.seed)
        return
    modes = [m for m in a.modes.split(",") if m]
    if a.iterations < 4 or a.repeats < 1 or not set(modes) <= {"warm", "inprocess"}:
        raise SystemExit("--iterations >= 4, --repeats >= 1, --modes from warm,inprocess")
    results = {}
    with workdir_with_server("ppoflow-async-") as (workdir, api_url):
        for mode in modes:
            runs: dict[int, list[dict]] = {k: [] for k in KS}
            for r in range(a.repeats):
                for k in KS if r % 2 == 0 else reversed(KS):
                    tag = f"{mode}-k{k}-{r}"
                    runs[k].append(run_variant(mode, k, workdir, api_url, a.iterations, a.threads, tag, seed=r))
            results[mode] = summarize(mode, runs)
    png = plot(results)
    figures = {
        "baseline": "max_staleness k = 0 (synchronous iterations), same mode, same config, same server",
        "iterations": a.iterations,
        "repeats": a.repeats,
        "threads_per_process": a.threads,
        "workload": WORKLOAD,
        "goal": f"warm k1 speedup >= {GOAL}, reward_at_equal_time k1 >= k0",
        "modes": results,
        "plot": str(png.relative_to(REPO)) if png else None,
    }
    if "warm" in results:
        figures["warm_k1_speedup"] = results["warm"]["k1"]["speedup"]
        figures["warm_k2_speedup"] = results["warm"]["k2"]["speedup"]
    if "inprocess" in results:
        figures["inprocess_k1_speedup"] = results["inprocess"]["k1"]["speedup"]
    emit("async", figures)


if __name__ == "__main__":
    main()
