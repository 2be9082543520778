"""ppoflow against Hugging Face TRL on identical work, one single-thread process at a time, alternating.

    python -m bench.peer_trl --size tiny     # 150 iterations: reward per iteration and per second, greedy accuracy
    python -m bench.peer_trl --size small    # a bigger random Llama, 3 iterations: time per iteration only

Trainers (each a fresh process with OMP_NUM_THREADS=1 and torch.set_num_threads(1)):
    trl_ppo_frozen    TRL 1.12.0 PPOTrainer after gc.freeze(): the PPO peer number
    trl_ppo_shipped   TRL 1.12.0 PPOTrainer as shipped (it calls gc.collect() twice per iteration)
    trl_ppo_bf16      TRL 1.12.0 PPOTrainer, frozen gc, with ppoflow's precision: bf16=True (bfloat16
                      autocast) and eager attention -- for the ratio at equal precision
    ppoflow_engine    ppoflow's engine loop (stages/loop.py), no Prefect, no storage
    ppoflow_pipeline  ppoflow's full pipeline: the Prefect flow flows/training.py:ppo_training, storage included
    trl_grpo, ppoflow_grpo_engine, ppoflow_grpo_pipeline: the same for GRPO (8 prompts x 8 samples)
TRL runs from its own venvs (bench/trl_env.py creates them when missing); ppoflow from this one.
Runs go seed by seed, every trainer once per seed in a fixed order (A B C D A B C D ...), so slow drift of
the machine spreads over all trainers. A trainer that is not available or fails is reported with the
reason and left out of the ratios, never silently.

Same work on both sides: the model folder built here (engines/toy/model.py), the digits prompts
(engines/toy/task.py make_rows), 8 new tokens, temperature 1, the digits reward ended at EOS or pad.
ppoflow runs with its CPU settings (bench/ppoflow_side.py CPU_SETTINGS: bfloat16 autocast where the CPU has
bfloat16 matmul kernels, float32 where it has not, eager attention, ZeRO stage 0, HF generate); TRL as it
runs by default (float32, SDPA) for the peer number,
and once more with bfloat16 autocast and eager attention (trl_ppo_bf16).
Figures: `ratio` = ppoflow full pipeline / TRL PPO (frozen gc) seconds per iteration in steady state
(per run the median over the iterations after the first, then the mean over seeds; goal <= 0.5),
`engine_ratio` = ppoflow engine loop / TRL PPO; `*_same_precision` the same against trl_ppo_bf16;
`*_with_first` use all iterations (seconds from the start
of training to the last iteration's record / iterations), so the pipeline's engine start-up inside its
first iteration is included. Setup before training (model loading; the engine loop's engine start) is
setup_s, the whole training call train_s, this process's CPU seconds per iteration cpu_iter_s (a check
against other load on a shared machine). tiny adds the mean reward at the last iteration over seeds
(goal: ppoflow >= TRL) and greedy accuracy on 64 held-out prompts. Per-iteration curves go to
bench/results/peer_trl_curves_<size>.json (plots: python -m bench.plots).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from bench.common import RESULTS_DIR, emit

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / ".work" / "peer_trl"
TRL_SIDE = REPO_ROOT / "bench" / "trl_side"


@dataclass(frozen=True)
class Size:
    """One benchmark size: the model to build and how long each trainer runs."""

    name: str
    model_kwargs: dict
    iterations: int
    greedy_eval: bool
    timeout_s: float


SIZES = {
    # The toy model of the tests (engines/toy/model.py defaults): vocab 64, hidden 128, 2 layers.
    "tiny": Size("tiny", {}, iterations=150, greedy_eval=True, timeout_s=1800),
    # A random Llama of 10.3M parameters (3 layers, hidden 512, head_dim 64). Measured on the project's
    # 2-core machine, one thread, 2026-11-21: TRL PPO (frozen gc) spent 7.3 CPU-s per iteration (4 layers:
    # 9.8, so 2 layers would sit near the 5 s floor); 3 iterations x 4 PPO trainers x 3 seeds ~ 5 minutes.
    "small": Size(
        "small",
        {"hidden_size": 512, "num_heads": 8, "num_layers": 3, "intermediate_size": 1536},
        iterations=3,
        greedy_eval=False,
        timeout_s=900,
    ),
}


@dataclass(frozen=True)
class Trainer:
    """One side of the comparison: `command(model_dir, seed, iterations, greedy)` builds its argv."""

    name: str
    algo: str  # "ppo" | "grpo"
    command: Callable[[Path, int, int, bool], list[str]]
    available: Callable[[], Optional[str]] = lambda: None  # None when runnable, else why not


def _trl_command(venv: str, script: str, *extra: str):
    def command(model_dir: Path, seed: int, iterations: int, greedy: bool) -> list[str]:
        from bench.trl_env import ensure_venv

        argv = [
            str(ensure_venv(venv)),
            str(TRL_SIDE / script),
            "--model",
            str(model_dir),
            "--seed",
            str(seed),
            "--iterations",
            str(iterations),
            *extra,
        ]
        return argv + (["--greedy-eval"] if greedy else [])

    return command


def _ppoflow_command(variant: str, algo: str):
    def command(model_dir: Path, seed: int, iterations: int, greedy: bool) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "bench.ppoflow_side",
            "--variant",
            variant,
            "--algo",
            algo,
            "--model",
            str(model_dir),
            "--seed",
            str(seed),
            "--iterations",
            str(iterations),
            "--work-dir",
            str(WORK_DIR / "runs"),
        ]
        return argv + (["--greedy-eval"] if greedy else [])

    return command


def _ppoflow_available(variant: str) -> Callable[[], Optional[str]]:
    def available() -> Optional[str]:
        if not (REPO_ROOT / "bench" / "ppoflow_side.py").exists():
            return "not available: bench/ppoflow_side.py does not exist yet"
        from bench.ppoflow_side import variant_unavailable  # the ppoflow side knows what it needs

        return variant_unavailable(variant)

    return available


TRAINERS = [
    Trainer("ppoflow_pipeline", "ppo", _ppoflow_command("pipeline", "ppo"), _ppoflow_available("pipeline")),
    Trainer("trl_ppo_frozen", "ppo", _trl_command("trl-ppo", "ppo_trl.py", "--gc", "frozen")),
    Trainer("ppoflow_engine", "ppo", _ppoflow_command("engine", "ppo"), _ppoflow_available("engine")),
    Trainer("trl_ppo_shipped", "ppo", _trl_command("trl-ppo", "ppo_trl.py", "--gc", "shipped")),
    Trainer("trl_ppo_bf16", "ppo", _trl_command("trl-ppo", "ppo_trl.py", "--gc", "frozen", "--precision", "bf16")),
    Trainer("ppoflow_grpo_pipeline", "grpo", _ppoflow_command("pipeline", "grpo"), _ppoflow_available("pipeline")),
    Trainer("trl_grpo", "grpo", _trl_command("trl-grpo", "grpo_trl.py")),
    Trainer("ppoflow_grpo_engine", "grpo", _ppoflow_command("engine", "grpo"), _ppoflow_available("engine")),
]


# ---- the harness: schedule, run, parse, aggregate -------------------------------------------------------


def alternating_schedule(trainers: list[str], seeds: list[int]) -> list[tuple[int, str]]:
    """(seed, trainer) in run order: every trainer once per seed, the trainers in the same order each seed.

    Raises ValueError on an empty or duplicated trainer list (a duplicate would run twice in a row).
    """
    if not trainers or len(set(trainers)) != len(trainers):
        raise ValueError(f"trainers must be a non-empty list of distinct names, got {trainers}")
    return [(seed, name) for seed in seeds for name in trainers]


def parse_records(stdout: str) -> tuple[list[dict], Optional[dict]]:
    """The progress records of one process (bench/trl_side/common.py protocol): (iterations, final).

    Lines that are not JSON objects with an "event" key are library output and are skipped.
    """
    iterations, final = [], None
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("event") == "iteration":
            iterations.append(record)
        elif record.get("event") == "final":
            final = record
    return iterations, final


def run_one(trainer: Trainer, size: Size, model_dir: Path, seed: int) -> dict:
    """Run one trainer process; returns {trainer, seed, ok, iterations, final, wall_s, error}."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO_ROOT),
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    result: dict[str, Any] = {"trainer": trainer.name, "seed": seed, "ok": False, "iterations": [], "final": None}
    start = time.perf_counter()
    try:
        argv = trainer.command(model_dir, seed, size.iterations, size.greedy_eval)
        proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=size.timeout_s)
    except subprocess.TimeoutExpired:
        result["error"] = f"timed out after {size.timeout_s} s"
    except (OSError, RuntimeError) as e:
        result["error"] = f"could not start: {e}"
    else:
        result["iterations"], result["final"] = parse_records(proc.stdout)
        result["ok"] = proc.returncode == 0 and result["final"] is not None
        if not result["ok"]:
            result["error"] = f"rc {proc.returncode}: {proc.stderr[-1500:]}"
    result["wall_s"] = time.perf_counter() - start
    return result


def _mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize_trainer(runs: list[dict], iterations: int) -> dict:
    """Aggregate one trainer's runs over seeds: means of per-run figures; failed runs only counted."""
    ok = [r for r in runs if r["ok"]]
    summary: dict[str, Any] = {"runs_ok": len(ok), "runs": len(runs)}
    if len(ok) < len(runs):
        summary["errors"] = [r.get("error", "")[-300:] for r in runs if not r["ok"]]
    if not ok:
        return summary
    # Training seconds up to the last iteration's record, per iteration: what follows the loop (TRL saves a
    # model card, ppoflow closes its flow) is not an iteration's cost; that total is in train_s.
    summary["iter_s"] = _mean([r["iterations"][-1]["wall_s"] / len(r["iterations"]) for r in ok if r["iterations"]])
    summary["train_s"] = _mean([r["final"].get("train_s") for r in ok])
    # this process's CPU seconds per iteration: what wall time would be on an idle machine (one thread);
    # misses helper processes, see bench/trl_side/common.Stopwatch
    summary["cpu_iter_s"] = _mean(
        [
            r["iterations"][-1]["cpu_s"] / len(r["iterations"])
            for r in ok
            if r["iterations"] and r["iterations"][-1].get("cpu_s") is not None
        ]
    )
    steady = [statistics.median([i["iter_s"] for i in r["iterations"][1:]]) for r in ok if len(r["iterations"]) > 1]
    summary["iter_s_steady"] = _mean(steady)  # median after the first iteration (warm-up left out)
    summary["setup_s"] = _mean([r["final"].get("setup_s") for r in ok])
    at_last = [r["iterations"][-1]["reward_mean"] for r in ok if len(r["iterations"]) == iterations]
    summary[f"reward_at_{iterations}"] = _mean(at_last)
    summary["reward_last10"] = _mean([_mean([i["reward_mean"] for i in r["iterations"][-10:]]) for r in ok])
    summary["greedy_reward"] = _mean([r["final"].get("greedy_reward") for r in ok])
    summary["greedy_exact"] = _mean([r["final"].get("greedy_exact") for r in ok])
    return summary


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return numerator / denominator if numerator is not None and denominator else None


def headline(summaries: dict[str, dict], iterations: int, unavailable: dict[str, str]) -> dict:
    """The figures of the final JSON line, from the per-trainer summaries."""

    def get(name: str, key: str):
        return summaries.get(name, {}).get(key)

    def ratio(ours: str, peer: str, key: str = "iter_s_steady"):
        return _ratio(get(ours, key), get(peer, key))

    reward_key = f"reward_at_{iterations}"
    figures: dict[str, Any] = {
        # steady state: engines start once per process (vLLM ~30 s), a cost every run pays once, shown
        # apart by the *_with_first ratios
        "ratio": ratio("ppoflow_pipeline", "trl_ppo_frozen"),
        "engine_ratio": ratio("ppoflow_engine", "trl_ppo_frozen"),
        "ratio_with_first": ratio("ppoflow_pipeline", "trl_ppo_frozen", "iter_s"),
        "engine_ratio_with_first": ratio("ppoflow_engine", "trl_ppo_frozen", "iter_s"),
        "ratio_same_precision": ratio("ppoflow_pipeline", "trl_ppo_bf16"),
        "engine_ratio_same_precision": ratio("ppoflow_engine", "trl_ppo_bf16"),
        "trl_bf16_speedup": ratio("trl_ppo_frozen", "trl_ppo_bf16"),
        "trl_gc_speedup": ratio("trl_ppo_shipped", "trl_ppo_frozen"),
        "grpo_ratio": ratio("ppoflow_grpo_pipeline", "trl_grpo"),
        "grpo_engine_ratio": ratio("ppoflow_grpo_engine", "trl_grpo"),
        "grpo_ratio_with_first": ratio("ppoflow_grpo_pipeline", "trl_grpo", "iter_s"),
        f"ppoflow_{reward_key}": get("ppoflow_pipeline", reward_key) or get("ppoflow_engine", reward_key),
        f"trl_{reward_key}": get("trl_ppo_frozen", reward_key),
        f"trl_bf16_{reward_key}": get("trl_ppo_bf16", reward_key),
        f"grpo_ppoflow_{reward_key}": get("ppoflow_grpo_pipeline", reward_key)
        or get("ppoflow_grpo_engine", reward_key),
        f"grpo_trl_{reward_key}": get("trl_grpo", reward_key),
    }
    for name, why in unavailable.items():
        figures[name] = why
    return figures


# ---- the run ---------------------------------------------------------------------------------------------


def build_model(size: Size) -> Path:
    """The shared model folder of this size under bench/.work (built once, reused by every process)."""
    from engines.toy.model import ensure_tiny_llama

    return ensure_tiny_llama(WORK_DIR / "models" / size.name, **size.model_kwargs)


def select_trainers(algos: list[str], only: Optional[list[str]]) -> tuple[list[Trainer], dict[str, str]]:
    """The runnable trainers of `algos` (and in `only` when given) and the reasons the others cannot run."""
    chosen, unavailable = [], {}
    for trainer in TRAINERS:
        if trainer.algo not in algos or (only and trainer.name not in only):
            continue
        why = trainer.available()
        if why:
            unavailable[trainer.name] = why
        else:
            chosen.append(trainer)
    return chosen, unavailable


def save_curves(size: Size, runs: list[dict]) -> Path:
    """Per-iteration records of every run, for the plots (bench/plots.py); overwritten each run of a size."""
    path = RESULTS_DIR / f"peer_trl_curves_{size.name}.json"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    curves = [
        {
            "trainer": r["trainer"],
            "seed": r["seed"],
            "ok": r["ok"],
            "iterations": [{k: i[k] for k in ("iteration", "reward_mean", "wall_s")} for i in r["iterations"]],
        }
        for r in runs
    ]
    path.write_text(json.dumps({"size": size.name, "runs": curves}))
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), required=True)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, every trainer once per seed")
    p.add_argument("--iterations", type=int, default=None, help="override the size's iterations (for trials)")
    p.add_argument("--algos", default="ppo,grpo", help="comma list of ppo, grpo")
    p.add_argument("--only", default=None, help="comma list of trainer names to run (default all available)")
    a = p.parse_args(argv)
    size = SIZES[a.size]
    if a.iterations is not None:
        size = Size(size.name, size.model_kwargs, a.iterations, size.greedy_eval, size.timeout_s)
    trainers, unavailable = select_trainers(a.algos.split(","), a.only.split(",") if a.only else None)
    model_dir = build_model(size)
    by_name = {t.name: t for t in trainers}
    runs = []
    for seed, name in alternating_schedule(list(by_name), list(range(a.seeds))):
        result = run_one(by_name[name], size, model_dir, seed)
        runs.append(result)
        final = result["final"] or {}
        print(
            f"# {name} seed {seed}: ok={result['ok']} train_s={final.get('train_s')} "
            f"reward_last={final.get('reward_last')} {result.get('error', '')[-300:]}",
            file=sys.stderr,
            flush=True,
        )
    summaries = {
        name: summarize_trainer([r for r in runs if r["trainer"] == name], size.iterations) for name in by_name
    }
    save_curves(size, runs)
    from bench.ppoflow_side import CPU_SETTINGS

    figures = {
        "size": size.name,
        "iterations": size.iterations,
        "seeds": a.seeds,
        "threads_per_process": 1,
        "model": {"path": str(model_dir.relative_to(REPO_ROOT)), **size.model_kwargs},
        "ppoflow_settings": CPU_SETTINGS,
        **headline(summaries, size.iterations, unavailable),
        "trainers": summaries,
        "plots": write_plots(size.name),
    }
    return emit("peer_trl", figures)


def write_plots(size: str) -> list[str] | str:
    """The PNG plots of this run's curves (bench/plots.py), or why there are none (matplotlib missing)."""
    from bench.plots import plot

    try:
        return [str(path.relative_to(REPO_ROOT)) for path in plot(size)]
    except ModuleNotFoundError as e:
        return f"no plots: {e}"


if __name__ == "__main__":
    main()
