"""Pipeline overhead: the same PPO iterations through the full pipeline (Prefect flows and tasks, Arrow
shards, checkpoints on local storage) and through the engines in a bare loop (no Prefect, no storage).

    python -m bench.overhead [--iterations 6] [--rounds 1] [--workload batch|tiny|both] [--vs TREE]

Each variant runs in its own fresh process (engines built from scratch in both). After each side's start-up and
first iteration (run alone, excluded from the figures), the two take turns one iteration at a time, the other
side stopped (SIGSTOP of its process group, Prefect's server included): bench/interleave.py says why (the host's
speed drifts more than the 5% this bench must resolve) and how. Per-iteration time: median over iterations 2..N
of every round; which side starts first alternates by round.

Same config, same seed, same tiny model and digits task; HF generate on both sides. Both sides draw
the same samples (one seed function), so their per-iteration rewards must be equal: `same_rewards`
checks that the pipeline computes what the bare loop computes.

Baseline: the bare engine loop. Figures:
- ratio: pipeline / bare per-iteration time on the `batch` workload (goal <= 1.05): 256 prompts x 8
  samples per iteration, about 5 s of compute per iteration on 2 cores. The pipeline's cost is mostly a
  fixed amount per iteration (a subflow run, four task runs, an artifact and the progress bar's update, shard
  and checkpoint writes), so the ratio depends on how long an iteration computes; real runs compute for minutes.
  Prefect's temporary server runs at nice 19 (adaptations/prefect_server.py): its background work would otherwise
  stall the compute's two threads on two cores (1.11-1.13 before, at nice 0).
- tiny_ratio: the same on the demo's workload (32 prompts x 4 samples, ~0.5 s of compute per
  iteration), where that fixed cost dominates.
- overhead_s_per_iter: pipeline minus bare seconds per iteration, per workload.
- vs (with --vs TREE, a source tree of another commit, e.g. `git worktree add ../old <commit>`): that commit's
  pipeline and bare sides take their turns in the same runs, four sides in all, so both commits' ratios come from
  iterations seconds apart on the same host; its figures per workload under "vs", its headline ratios and commit
  under the line's "vs". The same Python runs both trees (one virtual environment).
- to_first_iteration_s (per side, median over rounds) and startup_extra_s (pipeline minus bare): what a user
  waits from starting the process to the end of iteration 1 (imports, Prefect's temporary server, the
  engines' builds, the first iteration), each side run alone then (the other stopped or not yet started).
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


WORKLOADS = {  # rollout settings per workload; everything else is shared
    "tiny": {"prompts_per_iteration": 32, "n_samples": 4},
    "batch": {"prompts_per_iteration": 256, "n_samples": 8},
}


def bench_config(
    workdir: str, run: str, iterations: int, workload: str = "tiny", extra: dict | None = None, seed: int = 0
):
    """The benches' toy config of `workload`; `extra`: config sections merged over it key by key (a bench's
    own workload or pipeline settings); `seed`: run.seed."""
    from engines.toy.model import ensure_tiny_llama
    from engines.toy.run_config import toy_config
    from engines.toy.task import ensure_digits_dataset

    model = ensure_tiny_llama(os.path.join(workdir, "model"))
    data = ensure_digits_dataset(os.path.join(workdir, "data"))
    sections = {
        "data": {"data_source_key": None},
        "rollout": {"engine": "hf", "max_new_tokens": 8, **WORKLOADS[workload]},
        "algo": {"name": "ppo", "kl_coef": 0.01},
        "train": {
            "micro_batch_size": 32,
            "train_batch_size": None,
            "ppo_epochs": 2,
            "actor_lr": 2e-3,
            "critic_lr": 2e-3,
            "warmup_steps": 0,
            "lr_schedule": "constant",
        },
        "score": {"cache": False},  # the bare loop has no cache; keep the work identical
        "pipeline": {"retries": 0, "retry_delay_s": 5.0},
    }
    for section, values in (extra or {}).items():
        sections[section] = {**sections.get(section, {}), **values}
    runs = os.path.join(workdir, "runs")
    return toy_config(runs, run, model, data, iterations=iterations, seed=seed, sections=sections)


def workload_figures(results: dict[str, dict]) -> dict:
    """The figures per workload (with its rollout settings) of `results` {workload: figures}, then the headline
    ratios: `ratio` of the batch workload, `tiny_ratio` of the tiny one (when measured)."""
    figures: dict = {"workloads": {w: {"rollout": WORKLOADS[w], **r} for w, r in results.items()}}
    if "batch" in results:
        figures["ratio"] = results["batch"]["ratio"]
    if "tiny" in results:
        figures["tiny_ratio"] = results["tiny"]["ratio"]
    return figures


def worker(variant: str, workdir: str, iterations: int, workload: str, run: str) -> None:
    """Run one variant in this process as run `run`; print {"variant", "ends", "rewards"} at the end.

    The controller needs each iteration's end as it happens: the pipeline's is its metrics row
    (`time/finished_unix` in <runs>/<run>/metrics.jsonl), the bare loop prints {"end": unix time} per iteration."""
    cfg = bench_config(workdir, run, iterations, workload)
    ends: list[float] = []
    if variant == "pipeline":
        from adaptations import install_process_adaptations
        from flows.training import ppo_training

        install_process_adaptations()  # as `ppoflow train` does, before Prefect starts its temporary server
        result = ppo_training(cfg.model_dump(mode="json"))
        ends = [row["time/finished_unix"] for row in result["iterations"]]
        rewards = [row["reward/mean"] for row in result["iterations"]]
    else:
        from stages.loop import EngineLoop

        loop = EngineLoop(cfg)
        rewards = []
        for i in range(1, iterations + 1):
            rewards.append(loop.run_iteration(i)["reward/mean"])
            ends.append(time.time())
            print(json.dumps({"end": ends[-1]}), flush=True)
    print(json.dumps({"variant": variant, "ends": ends, "rewards": rewards}), flush=True)


def _start_side(variant: str, workdir: str, iterations: int, workload: str, run: str, tree: Path = REPO, name=None):
    """One side: `variant` run by `python -m bench.overhead --worker` in source tree `tree` (this one, or --vs's)."""
    from bench.interleave import MetricsEnds, Side

    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        "DS_ACCELERATOR": "cpu",
        "PREFECT_HOME": os.path.join(workdir, f"prefect-home-{run}"),
        "PYTHONUNBUFFERED": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    env.pop("PREFECT_API_URL", None)  # the embedded default: Prefect's local ephemeral server
    argv = [sys.executable, "-m", "bench.overhead", "--worker", variant, "--workdir", workdir]
    argv += ["--iterations", str(iterations), "--workload", workload, "--run", run]
    if variant == "pipeline":
        ends = MetricsEnds(os.path.join(workdir, "runs", run, "metrics.jsonl"))
    else:
        ends = lambda: [line["end"] for line in side.printed("end")]  # noqa: E731
    side = Side(name or variant, argv, ends, cwd=tree, env=env)
    return side


def source_tree(path: str) -> dict:
    """--vs's source tree: its absolute path and commit. `python -m` there must import that tree's modules, not this
    one's (an editable install of ppoflow resolves after the working folder): checked, ValueError naming the path."""
    tree = Path(path).resolve()
    probe = subprocess.run(
        [sys.executable, "-c", "import flows, stages; print(flows.__file__); print(stages.__file__)"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = probe.stdout.split()
    if probe.returncode != 0 or not found or any(not Path(f).resolve().is_relative_to(tree) for f in found):
        raise ValueError(f"--vs {path}: python there imports {found or probe.stderr[-500:]}, not that tree's modules")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    return {"tree": str(tree), "commit": commit.stdout.strip() or "unknown"}


def side_figures(times: dict, first: dict, rewards: dict) -> dict:
    """One tree's figures from its sides' per-iteration seconds {pipeline, bare: [...]}, their start-up seconds to the
    end of iteration 1 ({variant: [per round]}) and rewards."""
    pipeline, bare = statistics.median(times["pipeline"]), statistics.median(times["bare"])
    # pairs: iteration k of both sides (the same samples, so the same work), measured seconds apart
    pairs = [p / b for p, b in zip(times["pipeline"], times["bare"])]
    return {
        "pipeline_s_per_iter": round(pipeline, 3),
        "bare_s_per_iter": round(bare, 3),
        "ratio": round(pipeline / bare, 3),
        "total_ratio": round(sum(times["pipeline"]) / sum(times["bare"]), 3),
        "pair_ratio_median": round(statistics.median(pairs), 3),
        "pair_ratio_quartiles": [round(q, 3) for q in statistics.quantiles(pairs, n=4)[::2]],
        "overhead_s_per_iter": round(pipeline - bare, 3),
        "to_first_iteration_s": {v: round(statistics.median(t), 3) for v, t in first.items()},
        "startup_extra_s": round(statistics.median(first["pipeline"]) - statistics.median(first["bare"]), 3),
        "same_rewards": rewards["pipeline"] == rewards["bare"],
        "rewards_pipeline": rewards["pipeline"],
        "pipeline_s": [round(t, 3) for t in times["pipeline"]],
        "bare_s": [round(t, 3) for t in times["bare"]],
    }


def measure(workload: str, iterations: int, rounds: int, workdir: str, vs: Path | None = None) -> dict:
    """Per-iteration seconds of both variants, measured in turns (bench/interleave.py) over `rounds` runs (the
    order of the sides reverses by run); medians over all iterations 2..`iterations` of all runs. With `vs` (another
    commit's source tree), its pipeline and bare sides take their turns in the same runs: its figures under "vs"."""
    from bench.interleave import run_in_turns

    trees = {"": REPO, **({"@vs": vs} if vs is not None else {})}
    names = [v + tag for tag in trees for v in ("pipeline", "bare")]
    times: dict[str, list[float]] = {n: [] for n in names}
    first: dict[str, list[float]] = {n: [] for n in names}  # process start -> end of iteration 1, alone
    rewards: dict[str, list] = {}
    for r in range(rounds):
        started = {}

        def starter(name: str):
            variant, at, vs_tag = name.partition("@")  # "pipeline" or "pipeline@vs"

            def start():
                # a run per workload, side and round: `--workload both` runs both workloads in one folder
                run = f"overhead-{workload}-{variant}-{r}" + (f"-{vs_tag}" if at else "")
                started[name] = _start_side(variant, workdir, iterations, workload, run, trees[at + vs_tag], name)
                return started[name]

            return start

        seconds = run_in_turns([starter(n) for n in (names if r % 2 == 0 else names[::-1])], iterations)
        for name in names:
            times[name] += seconds[name]
            rewards[name] = started[name].result("variant")["rewards"]
            first[name].append(started[name].ends()[0] - started[name].started_at)

    def tree_figures(tag: str) -> dict:
        return side_figures(*({v: d[v + tag] for v in ("pipeline", "bare")} for d in (times, first, rewards)))

    return {**tree_figures(""), **({"vs": tree_figures("@vs")} if vs is not None else {})}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workload", choices=["batch", "tiny", "both"], default="both")
    p.add_argument("--worker", choices=["pipeline", "bare"])
    p.add_argument("--workdir")
    p.add_argument("--run")
    p.add_argument("--vs", help="another commit's source tree (a git worktree) measured in the same turns")
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.workdir, a.iterations, a.workload, a.run)
        return
    if (a.iterations - 1) * a.rounds < 2:  # quartiles of the pairs need two of them
        raise SystemExit(
            f"--iterations {a.iterations} --rounds {a.rounds} measures {(a.iterations - 1) * a.rounds} iteration(s) "
            "per side; at least 2 are needed (the first iteration of each round is excluded)"
        )
    workloads = ["batch", "tiny"] if a.workload == "both" else [a.workload]
    vs = source_tree(a.vs) if a.vs else None
    with tempfile.TemporaryDirectory(prefix="ppoflow-overhead-") as workdir:
        tree = Path(vs["tree"]) if vs else None
        results = {w: measure(w, a.iterations, a.rounds, workdir, tree) for w in workloads}
    figures = {
        "baseline": "bare engine loop (no Prefect, no storage)",
        "iterations": a.iterations,
        "rounds": a.rounds,
        "method": "in turns: both sides warm, one iteration each in turn, the other stopped (bench/interleave.py)",
        "goal": "<= 1.05",
        **workload_figures(results),
    }
    if vs:  # the other commit's headline ratios, measured in the same turns
        headline = {"batch": "ratio", "tiny": "tiny_ratio"}
        figures["vs"] = {**vs, **{headline[w]: r["vs"]["ratio"] for w, r in results.items()}}
    emit("overhead", figures)


if __name__ == "__main__":
    main()
