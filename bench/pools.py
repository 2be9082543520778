"""Warm stage workers against in-process, and against process work pools (the before): seconds per iteration.

    python -m bench.pools [--workload batch|tiny|both] [--iterations 6] [--repeats 2] [--pool-iterations 3]

One loopback Prefect server (`prefect server start`, SQLite) serves every variant. The same config
(bench.overhead's workloads, engines/toy's config, HF generate) runs three ways, each from a fresh driver
process that calls the training flow:
- inprocess: the default; every stage task runs in the driver process (the baseline).
- warm: `pipeline.stage_workers: [rollout, score, update]`; three `ppoflow worker` processes (rollout; score;
  update), started with the driver, run the stage tasks and keep their engines; the checkpoint stage (a commit,
  no engine) runs in the flow (bench/processes.py's WARM_GROUPS says why).
- pools: `pipeline.stage_pools`; the stage deployments of prefect.yaml on process work pools, one
  `prefect worker start --type process` per pool: a fresh process per stage per iteration (Prefect's default
  worker polling, 10 s). Slow, so it runs once per workload with --pool-iterations (3) iterations.
inprocess and warm are measured in turns (bench/interleave.py): each starts (driver and workers) and runs its
first iteration alone, then the two take turns one iteration at a time, the other side's driver and workers
stopped; which side starts first alternates by repeat. The host's speed drifts more over minutes than the goal's
margin; in turns, each warm iteration has an in-process iteration seconds away. pools follows the first pair,
alone (its stage flows wait on Prefect's worker polling, which a stopped side would distort).

Figures per workload and variant (medians over repeats):
- startup_s: from starting the processes (driver; workers for warm/pools) to the end of iteration 1, i.e.
  what a user waits for the first iteration: imports, worker start and pickup, engine builds.
- s_per_iter: median seconds per iteration after the first (steady state): the time between the ends of
  consecutive iterations, less the time the side was stopped in between (in turns).
- dispatch_ms: fixed cost per stage dispatch = a stage's wall time seen by the flow (metrics row
  `timing/<stage>`) minus the stage body's own `seconds` (its stage record, measured inside the stage body
  wherever it ran); median over the stages of iterations 2..N (per stage too). It holds task-run
  orchestration, submission and pickup, result persistence and the stage record write.
- first_dispatch_ms: the same for iteration 1 (a worker's first pickup, a pool's process start).
- ratio: warm / inprocess s_per_iter (goal <= 1.15 on batch); pools_ratio: pools / inprocess.
Checks from the stage records (`worker` = host:pid, `engine_builds`): every warm stage ran on the worker
started for its group (the checkpoint in the driver), no warm worker built an engine after its first stage
(builds constant from the first iteration on), pools ran each stage in a new process every iteration; rewards
equal in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from typing import TYPE_CHECKING

from bench.common import emit
from bench.overhead import bench_config, workload_figures
from bench.processes import (
    POOLS,
    REPO,
    STAGES,
    WARM_GROUPS,
    add_driver_arguments,
    child_env,
    create_process_pools,
    prefect_cli,
    run_driver,
    start_workers,
    stop_workers,
    train_in_driver,
    variant_sections,
    workdir_with_server,
)

if TYPE_CHECKING:
    from bench.interleave import Side

GOAL = 1.15


def variant_config(workdir: str, run: str, iterations: int, workload: str, variant: str):
    """bench.overhead's config of `workload` with the pipeline section of `variant` (inprocess|warm|pools)."""
    return bench_config(workdir, run, iterations, workload, extra=variant_sections(variant))


def driver(variant: str, workdir: str, run: str, iterations: int, workload: str) -> None:
    """Run the training flow once in this process; print its metrics rows and stage records as one JSON line."""
    from storage.stage_records import read_stage_record

    keep = ("iteration", "reward/mean", "time/finished_unix", *[f"timing/{s}" for s in STAGES])
    layout, rows = train_in_driver(variant_config(workdir, run, iterations, workload, variant), keep)
    records = {stage: [read_stage_record(layout, i, stage) for i in range(1, iterations + 1)] for stage in STAGES}
    print(json.dumps({"driver": variant, "rows": rows, "records": records}), flush=True)


def run_variant(variant: str, workdir: str, api_url: str, iterations: int, workload: str, tag: str) -> dict:
    """Start the variant's workers and driver; returns the driver's rows and records, t0, and worker pids."""
    args = ["--driver", variant, "--workdir", workdir, "--run", tag]
    args += ["--iterations", str(iterations), "--workload", workload]
    return run_driver("bench.pools", args, variant, workdir, child_env(workdir, api_url), tag)


@dataclasses.dataclass(frozen=True)
class StartedSide:
    """A side of a measurement in turns with what bench.pools keeps beside it: when its processes were started
    (the start of its start-up time) and its workers ({stage group: process}, stopped with it)."""

    side: Side
    t0: float
    workers: dict


def start_side(variant: str, workdir: str, api_url: str, iterations: int, workload: str, tag: str) -> StartedSide:
    """Start `variant`'s workers and driver as one side of a measurement in turns (bench/interleave.py)."""
    from bench.interleave import MetricsEnds, Side

    env = child_env(workdir, api_url)
    t0 = time.time()
    workers = start_workers(variant, workdir, env, tag)
    argv = [sys.executable, "-m", "bench.pools", "--driver", variant, "--workdir", workdir, "--run", tag]
    argv += ["--iterations", str(iterations), "--workload", workload]
    ends = MetricsEnds(os.path.join(workdir, "runs", tag, "metrics.jsonl"))
    side = Side(variant, argv, ends, companions=tuple(w.pid for w in workers.values()), cwd=REPO, env=env)
    return StartedSide(side, t0, workers)


def run_in_turns_pair(first: str, second: str, workdir: str, api_url: str, a, workload: str, r: int) -> dict:
    """One repeat of two variants in turns; returns {variant: data} as run_variant does, plus `active_s`."""
    from bench.interleave import run_in_turns

    started: dict[str, StartedSide] = {}

    def starter(variant: str):
        def start():
            tag = f"{variant}-{workload}-{r}"
            started[variant] = start_side(variant, workdir, api_url, a.iterations, workload, tag)
            return started[variant].side

        return start

    try:
        seconds = run_in_turns([starter(first), starter(second)], a.iterations)
    finally:
        for one in started.values():
            stop_workers(list(one.workers.values()))
    out = {}
    for variant, one in started.items():
        pids = {g: w.pid for g, w in one.workers.items()}
        out[variant] = {**one.side.result("driver"), "t0": one.t0, "pids": pids, "active_s": seconds[variant]}
    return out


def timings(data: dict) -> dict:
    """startup_s, s_per_iter, dispatch and stage body figures of one variant run (see the module docstring)."""
    rows, records = data["rows"], data["records"]
    ends = [row["time/finished_unix"] for row in rows]
    later = range(1, len(ends))
    per_iteration = data.get("active_s") or [b - a for a, b in zip(ends, ends[1:])]  # active_s: run in turns
    dispatch = {
        s: [1e3 * (rows[i][f"timing/{s}"] - records[s][i]["seconds"]) for i in range(len(ends))] for s in STAGES
    }
    return {
        "startup_s": ends[0] - data["t0"],
        "s_per_iter": statistics.median(per_iteration),
        "dispatch_ms": statistics.median(dispatch[s][i] for s in STAGES for i in later),
        "dispatch_ms_by_stage": {s: statistics.median(dispatch[s][i] for i in later) for s in STAGES},
        "first_dispatch_ms": {s: dispatch[s][0] for s in STAGES},
        "body_s_by_stage": {s: statistics.median(records[s][i]["seconds"] for i in later) for s in STAGES},
    }


def worker_checks(variant: str, data: dict) -> dict:
    """What the stage records say about where each stage ran and how often engines were built."""
    records = data["records"]
    builds = {s: [r["engine_builds"] for r in records[s]] for s in STAGES}
    workers = {s: sorted({r["worker"] for r in records[s]}) for s in STAGES}
    facts: dict = {"engine_builds": builds}
    if variant == "warm":
        host = socket.gethostname()
        expected = {s: f"{host}:{data['pids'][g]}" for g, stages in WARM_GROUPS.items() for s in stages}
        # the stages no worker serves (the checkpoint) ran in the flow: one process that is none of the workers
        in_flow = {w for s in STAGES if s not in expected for w in workers[s]}
        facts["all_on_their_worker"] = all(workers[s] == [expected[s]] for s in expected) and (
            len(in_flow) <= 1 and not in_flow & set(expected.values())
        )
        # A worker's build count, read at the end of each of its stages, never grows after iteration 1.
        facts["no_rebuild_after_first"] = all(b == [b[0]] * len(b) for b in builds.values())
    elif variant == "pools":
        facts["new_process_every_stage"] = all(len(workers[s]) == len(records[s]) for s in STAGES)
    else:
        facts["one_process"] = len({w for s in STAGES for w in workers[s]}) == 1
    return facts


def deploy_pools(api_url: str, workdir: str) -> None:
    """Create the process work pools and deploy prefect.yaml (as tests/integration/test_pipeline_pools.py does)."""
    create_process_pools(POOLS, api_url)
    out = prefect_cli("--no-prompt", "deploy", "--all", env=child_env(workdir, api_url))
    if out.returncode != 0:
        raise RuntimeError(f"prefect deploy --all: {out.stdout[-3000:]}{out.stderr[-3000:]}")


def summarize(runs: list[dict]) -> dict:
    """Medians over the repeats of one variant (per stage for per-stage figures); every repeat's checks must hold."""
    ts = [timings(r) for r in runs]
    out: dict = {}
    for key, value in ts[0].items():
        if isinstance(value, dict):
            out[key] = {s: round(statistics.median(t[key][s] for t in ts), 3) for s in value}
        else:
            out[key] = round(statistics.median(t[key] for t in ts), 3)
    out["runs"] = len(runs)
    checks = [worker_checks(r["driver"], r) for r in runs]
    out["checks"] = {k: all(c[k] for c in checks) for k in checks[0] if k != "engine_builds"}
    out["engine_builds"] = checks[-1]["engine_builds"]
    return out


def measure(workload: str, a: argparse.Namespace, workdir: str, api_url: str) -> dict:
    runs: dict[str, list[dict]] = {"inprocess": [], "warm": []}
    for r in range(a.repeats):
        order = ("inprocess", "warm") if r % 2 == 0 else ("warm", "inprocess")
        for variant, data in run_in_turns_pair(*order, workdir, api_url, a, workload, r).items():
            runs[variant].append(data)
        if r == 0 and a.pool_iterations:
            runs["pools"] = [run_variant("pools", workdir, api_url, a.pool_iterations, workload, f"pools-{workload}")]
    result = {v: summarize(rs) for v, rs in runs.items()}
    base = result["inprocess"]["s_per_iter"]
    result["ratio"] = round(result["warm"]["s_per_iter"] / base, 3)
    if "pools" in result:
        result["pools_ratio"] = round(result["pools"]["s_per_iter"] / base, 3)
    rewards = {v: [row["reward/mean"] for row in rs[0]["rows"]] for v, rs in runs.items()}
    result["same_rewards"] = all(rewards[v] == rewards["inprocess"][: len(rewards[v])] for v in rewards)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["batch", "tiny", "both"], default="both")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2, help="inprocess/warm pairs per workload")
    p.add_argument("--pool-iterations", type=int, default=3, help="iterations of the pools run (0: skip it)")
    add_driver_arguments(p, ["inprocess", "warm", "pools"])
    a = p.parse_args(argv)
    if a.driver:
        driver(a.driver, a.workdir, a.run, a.iterations, a.workload)
        return
    if a.iterations < 2 or a.pool_iterations == 1 or a.repeats < 1:
        raise SystemExit("--iterations and --pool-iterations must be >= 2 (or 0 to skip pools), --repeats >= 1")
    workloads = ["batch", "tiny"] if a.workload == "both" else [a.workload]
    with workdir_with_server("ppoflow-pools-") as (workdir, api_url):
        if a.pool_iterations:
            deploy_pools(api_url, workdir)
        results = {w: measure(w, a, workdir, api_url) for w in workloads}
    figures = {
        "baseline": "in-process stages (the default), same config, same loopback Prefect server",
        "iterations": a.iterations,
        "pool_iterations": a.pool_iterations,
        "repeats": a.repeats,
        "goal": f"warm/inprocess <= {GOAL} on batch",
        **workload_figures(results),
    }
    emit("pools", figures)


if __name__ == "__main__":
    main()
