"""A real pretrained model on the real recipe: rollout, update and pipeline figures of SmolLM2-135M on basic_arithmetic.

    python -m bench.real_model                       # the whole bench (~10 min on 2 idle cores)
    python -m bench.real_model --prompts 8 --rounds 1 --update-prompts 2 --updates 1 --skip-pipeline \
        --results-dir /tmp/smoke                     # a smoke run of the same code, its line kept elsewhere

The model is `ppoflow models fetch`'s SmolLM2-135M-Instruct (float32, engines/pretrained.py), the recipe is
configs/real_arithmetic.yaml (GRPO, 16 prompts x 4 samples x 16 new tokens, chat template, vLLM rollouts); the
prompts are the recipe's own (data.reasoning_gym through engines/reasoning_tasks.py and engines/data.py's
PromptSource, iteration 1's rows, each seeded as the rollout stage seeds it). Four parts, each with its baseline:

1. Rollout (baseline: ppoflow's HF-generate engine). The same --prompts chat prompts, --new-tokens sampled tokens
   each (temperature 1, n = 1, seeded), through engines/rollout/vllm_engine.py and engines/rollout/hf.py built as
   the registry builds them. Both generate exactly --new-tokens tokens per prompt, so both do the same work: vLLM
   with ignore_eos (EOS masked), HF with its tokenizer's EOS hidden (an EOS it samples is just a token). Each side:
   start-up seconds, its first generate, then --rounds generates alternated vllm, hf, vllm, hf. Both engines stay
   up; an idle vLLM engine polls its queues (vllm_idle_cpu_share: its processes' CPU seconds per second over 3 s
   of idling), so its processes are stopped (SIGSTOP) while the HF side starts and generates
   (vllm_core_cpu_s_during_hf checks it: 0). Steady = median of the rounds.
2. Update (baseline: the machine's matmul peak). PPOTrainer (engines/trainer/ppo_trainer.py, DeepSpeed, as the
   update stage runs it) on one batch of the recipe's shape: the recipe's prompts x n_samples, max_new_tokens
   random response tokens each (no EOS: every token is work), random rewards per group. Trainer set-up (DeepSpeed) and
   the first update beside the median of --updates more. FLOPs ~ 6 x params x tokens per epoch (forward+backward)
   plus 2 x params x tokens for the separate old-log-prob forward when the trainer takes one; tokens = the padded
   prompt+response columns the forwards process. Peak = the best torch.mm GFLOP/s on the model's own shapes (one
   micro-batch's tokens x 576 by 576 x 1536 MLP, 576 x 576 attention, 576 x 49152 head) at the same thread count.
3. Pipeline (baseline: part 2's bare update, and the pipeline's own steady state). `ppoflow train` on the recipe
   as a subprocess (a temp run.root, --pipeline-iterations plain iterations: no eval, no held-out rows), its
   timing/* per stage and per iteration, first and steady (median of the rest); wall seconds from the process's
   start to the end of iteration 1 (what a user waits); the peak RSS of its process tree (sum over processes,
   polled every 0.5 s: shared pages count once per process).
4. Accuracy before/after: eval/accuracy of row 0 and of the last row holding it in a finished recipe run's
   metrics.jsonl (--run-dir, default ./runs/real-arithmetic); keys absent when the run or its rows are.

Threads: torch.set_num_threads(--threads, default every core this process may use); vLLM's CPU worker is bound
to the same cores (VLLM_CPU_OMP_THREADS_BIND, none reserved). The pipeline subprocess gets the environment this
process started with (what a user's `ppoflow train` gets). Ends with one JSON line (bench/common.py emit),
appended to bench/results/real_model.jsonl (or --results-dir).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.common import emit

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "real_arithmetic.yaml"
MODEL_NAME = "smollm2-135m-instruct"
# (in, out) of the model's matmuls: MLP gate/up, attention q/o, the tied LM head (hidden 576, vocab 49,152)
MATMUL_SHAPES = {"mlp_576x1536": (576, 1536), "attn_576x576": (576, 576), "head_576x49152": (576, 49152)}


# ---- pure helpers (tests/unit/test_bench_real_model.py) ----------------------------------------------------
def update_flops(params: int, tokens: int, epochs: int, old_logprobs_forward: bool) -> float:
    """Approximate FLOPs of one update: 6 x params x tokens per epoch (forward 2, backward 4), plus one
    forward (2 x params x tokens) when old log-probs need a pass of their own."""
    return params * tokens * (6 * epochs + (2 if old_logprobs_forward else 0))


def stage_seconds(rows: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """({timing key: seconds of the first iteration}, {timing key: median over the later ones}) from
    metrics rows of iterations >= 1; a key missing from every later row is absent from the steady dict."""
    its = sorted((r for r in rows if r.get("iteration", 0) >= 1), key=lambda r: r["iteration"])
    if not its:
        return {}, {}
    first = {k: v for k, v in its[0].items() if k.startswith("timing/")}
    keys = sorted({k for r in its[1:] for k in r if k.startswith("timing/")})
    steady = {k: statistics.median(r[k] for r in its[1:] if k in r) for k in keys}
    return first, steady


def accuracy_figures(rows: list[dict]) -> dict:
    """eval/accuracy before training (row of iteration 0) and after (the last later row holding it), with
    the gain in points and their ratio; only the figures the rows hold."""
    before = next((r["eval/accuracy"] for r in rows if r.get("iteration") == 0 and "eval/accuracy" in r), None)
    later = [r for r in rows if r.get("iteration", 0) >= 1 and "eval/accuracy" in r]
    out: dict = {}
    if before is not None:
        out["accuracy_before"] = before
    if later:
        out["accuracy_after"], out["accuracy_after_iteration"] = later[-1]["eval/accuracy"], later[-1]["iteration"]
    if before is not None and later:
        out["accuracy_gain"] = round(out["accuracy_after"] - before, 4)
        if before > 0:
            out["accuracy_after_over_before"] = round(out["accuracy_after"] / before, 3)
    return out


# ---- the recipe --------------------------------------------------------------------------------------------
def recipe(root: Path, overrides: list[str] = ()):
    """The recipe's config with its data generated under `root` (no held-out rows) and its model fetched."""
    from engines.pretrained import fetch_model
    from engines.reasoning_tasks import materialize
    from ppoflow.config import load_config

    cfg = load_config(RECIPE, [f"run.root={root}", "data.reasoning_gym.eval_size=0", *overrides])
    model_dir = fetch_model(MODEL_NAME, (REPO / cfg.model.policy_path).parent)
    return materialize(cfg.model_copy(update={"model": cfg.model.model_copy(update={"policy_path": str(model_dir)})}))


def recipe_prompts(cfg, count: int) -> tuple[list[list[int]], list[int]]:
    """Token ids (chat template applied) of `count` prompts of iteration 1, and each prompt's sampling seed."""
    from engines.data import PromptSource
    from engines.models import load_tokenizer
    from engines.rollout.base import prompt_sampling_seed

    source = PromptSource(cfg.data, load_tokenizer(cfg.model.policy_path), cfg.model.apply_chat_template)
    records = source.prompts_for_iteration(1, count, cfg.run.seed)
    return [r.prompt_ids for r in records], [prompt_sampling_seed(cfg.run.seed, 1, r.index) for r in records]


# ---- 1. rollout --------------------------------------------------------------------------------------------
class _TokenizerWithoutEos:
    """The HF engine's tokenizer with its EOS hidden, so every sample runs to max_new_tokens (bench only)."""

    eos_token_id = None

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _children_cpu_s() -> float:
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


@contextlib.contextmanager
def _children_stopped():
    """This process's children (the vLLM engine core and its worker) stopped (SIGSTOP) for the block's length:
    an idle vLLM engine polls its queues and would take CPU from the HF side on a 2-core machine."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        child.suspend()
    try:
        yield
    finally:
        for child in children:
            child.resume()


def idle_cpu_share(seconds: float = 3.0) -> float:
    """CPU seconds this process's children use per wall second while nothing is asked of them."""
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    time.sleep(seconds)
    return (_children_cpu_s() - cpu0) / (time.perf_counter() - t0)


def measure_rollout(cfg, prompts, seeds, new_tokens: int, rounds: int) -> dict:
    from engines.rollout.base import SamplingSettings
    from engines.rollout.hf import HFRolloutEngine
    from engines.rollout.vllm_engine import VLLMRolloutEngine
    from engines.rollout.vllm_logprobs import logprobs_mode_for

    sampling = SamplingSettings(n=1, temperature=1.0, max_new_tokens=new_tokens)
    m, policy = cfg.model, cfg.model.policy_path
    starts = {
        "vllm": lambda: VLLMRolloutEngine(
            policy,
            seed=cfg.run.seed,
            dtype=m.dtype,
            max_model_len=cfg.rollout.max_model_len,
            kv_cache_space_gib=cfg.rollout.kv_cache_space_gib or 1.0,
            logprobs_mode=logprobs_mode_for(sampling),
        ),
        "hf": lambda: HFRolloutEngine(
            policy, dtype=m.dtype, attn_implementation=m.attn_implementation, autocast_dtype=m.autocast_dtype
        ),
    }
    engines: dict = {}
    seconds: dict[str, list[float]] = {"vllm": [], "hf": []}
    startup: dict[str, float] = {}
    vllm_cpu_during_hf, vllm_idle_share = 0.0, 0.0

    def generate(name: str) -> None:
        nonlocal vllm_cpu_during_hf
        extra = {"ignore_eos": True} if name == "vllm" else {}
        with _children_stopped() if name == "hf" else contextlib.nullcontext():
            cpu0, t0 = _children_cpu_s(), time.perf_counter()
            samples = engines[name].generate(prompts, sampling, seeds, **extra)
            seconds[name].append(time.perf_counter() - t0)
            if name == "hf":
                vllm_cpu_during_hf += _children_cpu_s() - cpu0
        got = sum(len(s.response_ids) for s in samples)
        if got != len(prompts) * new_tokens:
            raise RuntimeError(f"unequal work: {name} generated {got} tokens, not {len(prompts)} x {new_tokens}")

    from flows.failure import raise_on_sigterm

    previous = raise_on_sigterm()  # a `kill` of this bench runs the finally: no engine left stopped or running
    try:
        for name in ("vllm", "hf"):  # start-up and first generate of each side, alone
            with _children_stopped() if name == "hf" else contextlib.nullcontext():
                t0 = time.perf_counter()
                engines[name] = starts[name]()
                startup[name] = time.perf_counter() - t0
            if name == "hf":
                engines[name].tokenizer = _TokenizerWithoutEos(engines[name].tokenizer)
            generate(name)
            if name == "vllm":
                vllm_idle_share = idle_cpu_share()
        for _ in range(rounds):
            for name in ("vllm", "hf"):
                generate(name)
    finally:
        for engine in engines.values():
            engine.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    tokens = len(prompts) * new_tokens
    steady = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    return {
        "rollout_baseline": "ppoflow HF-generate engine (engines/rollout/hf.py), same prompts, seeds and lengths",
        "rollout_prompts": len(prompts),
        "rollout_prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
        "rollout_new_tokens": new_tokens,
        "rollout_rounds": rounds,
        "vllm_tokens_per_s": round(tokens / steady["vllm"], 1),
        "hf_tokens_per_s": round(tokens / steady["hf"], 1),
        "ratio_vllm_over_hf": round(steady["hf"] / steady["vllm"], 3),
        "vllm_startup_s": round(startup["vllm"], 2),
        "hf_startup_s": round(startup["hf"], 2),
        "vllm_first_generate_s": round(seconds["vllm"][0], 2),
        "hf_first_generate_s": round(seconds["hf"][0], 2),
        "vllm_generate_s": [round(s, 2) for s in seconds["vllm"][1:]],
        "hf_generate_s": [round(s, 2) for s in seconds["hf"][1:]],
        "vllm_idle_cpu_share": round(vllm_idle_share, 2),
        "vllm_core_cpu_s_during_hf": round(vllm_cpu_during_hf, 2),
    }


# ---- 2. update ---------------------------------------------------------------------------------------------
def recipe_batch(cfg, response_len: int, seed: int = 0):
    """An ExperienceBatch of the recipe's shape: its prompts x n_samples, random response tokens (no special
    ids), random rewards and log-probs, one group per prompt."""
    import torch

    from engines.models import load_tokenizer
    from engines.trainer.experience import ExperienceBatch

    n = cfg.rollout.n_samples
    prompts, _ = recipe_prompts(cfg, cfg.rollout.prompts_per_iteration)
    tokenizer = load_tokenizer(cfg.model.policy_path)
    rows = len(prompts) * n
    g = torch.Generator().manual_seed(seed)
    response = torch.randint(max(tokenizer.all_special_ids) + 1, len(tokenizer), (rows, response_len), generator=g)
    logprobs = (-torch.rand(rows, response_len, generator=g) * 5).tolist()
    return ExperienceBatch.from_lists(
        [p for p in prompts for _ in range(n)],
        response.tolist(),
        torch.rand(rows, generator=g).tolist(),
        logprobs,
        rollout_logprobs=logprobs,
        group_ids=[i // n for i in range(rows)],
        pad_token_id=tokenizer.pad_token_id or 0,
        finish_reasons=["length"] * rows,
    )


def matmul_gflops(m: int, k: int, n: int, min_s: float = 0.3, windows: int = 3) -> float:
    """Best of `windows` windows of >= min_s of torch.mm (m, k) x (k, n) in float32, GFLOP/s."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    best = 0.0
    for _ in range(windows):
        reps, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < min_s or reps == 0:
            torch.mm(a, b)
            reps += 1
        best = max(best, 2 * m * k * n * reps / elapsed / 1e9)
    return best


def measure_update(cfg, updates: int) -> dict:
    from engines.trainer.ppo_trainer import PPOTrainer

    batch = recipe_batch(cfg, cfg.rollout.max_new_tokens)
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg, cfg.model.policy_path)
    setup_s = time.perf_counter() - t0
    old_forward = not trainer._old_from_first_forward(batch)
    seconds = []
    for _ in range(updates + 1):
        t0 = time.perf_counter()
        trainer.update(batch)
        seconds.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in trainer.actor.module.parameters())
    models = 2 if trainer.critic is not None else 1
    del trainer
    width = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    processed = len(batch) * width  # padded columns: what the forwards compute
    real = int(batch.prompt_mask.sum()) + int(batch.response_mask.sum())
    flops = models * update_flops(params, processed, cfg.train.ppo_epochs, old_forward)
    steady = statistics.median(seconds[1:])
    micro_tokens = min(cfg.train.micro_batch_size, len(batch)) * width
    peaks = {name: matmul_gflops(micro_tokens, k, n) for name, (k, n) in MATMUL_SHAPES.items()}
    achieved = flops / steady / 1e9
    return {
        "update_baseline": "torch.mm peak on the model's shapes, same threads",
        "update_rows": len(batch),
        "update_tokens": real,
        "update_tokens_processed": processed,
        "update_params": params,
        "update_epochs": cfg.train.ppo_epochs,
        "update_old_logprobs_forward": old_forward,
        "trainer_setup_s": round(setup_s, 2),
        "update_first_s": round(seconds[0], 2),
        "update_s": [round(s, 2) for s in seconds[1:]],
        "update_steady_s": round(steady, 2),
        "update_tokens_per_s": round(real / steady, 1),
        "update_gflops": round(achieved, 1),
        "matmul_gflops": {name: round(g, 1) for name, g in peaks.items()},
        "matmul_peak_gflops": round(max(peaks.values()), 1),
        "update_over_peak": round(achieved / max(peaks.values()), 3),
    }


# ---- 3. pipeline -------------------------------------------------------------------------------------------
def _tree_rss(proc) -> int:
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_train(root: Path, sets: list[str], env: dict, timeout_s: float) -> tuple[list[dict], float, int]:
    """`ppoflow train` on the recipe with `sets` (run.root among them) as a subprocess, its output in
    root/train.log: (its metrics rows, the wall time it started at, the peak RSS of its process tree in bytes).
    Raises RuntimeError with the log's tail when it fails or outlives `timeout_s` (it is killed)."""
    import psutil

    from ppoflow.config import load_config

    argv = [str(Path(sys.executable).parent / "ppoflow"), "train", str(RECIPE)]
    argv += [a for s in sets for a in ("--set", s)]
    run_name = load_config(RECIPE, sets).run.name
    with open(root / "train.log", "w") as log:
        started = time.time()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        watched, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss(watched))
            if time.time() - started > timeout_s:
                proc.kill()
                break
            time.sleep(0.5)
    if proc.wait() != 0:
        tail = (root / "train.log").read_text()[-4000:]
        raise RuntimeError(f"ppoflow train failed (rc {proc.returncode}):\n{tail}")
    rows = [json.loads(line) for line in (root / run_name / "metrics.jsonl").read_text().splitlines() if line]
    return rows, started, peak


def measure_pipeline(iterations: int, extra_sets: list[str], env: dict, timeout_s: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix="ppoflow-bench-real-"))
    sets = [f"run.root={root}", f"run.iterations={iterations}", "eval.before_training=false"]
    sets += ["data.reasoning_gym.eval_size=0", *extra_sets]
    try:
        rows, started, peak = run_train(root, sets, env, timeout_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first, steady = stage_seconds(rows)
    row1 = next(r for r in rows if r.get("iteration") == 1)
    out = {
        "pipeline_iterations": iterations,
        "pipeline_sets": extra_sets,
        "pipeline_engine": row1.get("rollout/engine"),
        "pipeline_to_first_iteration_s": round(row1["time/finished_unix"] - started, 1),
        "pipeline_first_s": {k.removeprefix("timing/"): round(v, 2) for k, v in first.items()},
        "pipeline_steady_s": {k.removeprefix("timing/"): round(v, 2) for k, v in steady.items()},
        "pipeline_peak_rss_gib": round(peak / 2**30, 2),
    }
    if "timing/iteration" in steady:
        out["pipeline_first_over_steady_iteration"] = round(first["timing/iteration"] / steady["timing/iteration"], 2)
    return out


# ---- main --------------------------------------------------------------------------------------------------
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64, help="rollout prompts (part 1)")
    p.add_argument("--new-tokens", type=int, default=32, help="sampled tokens per rollout prompt (part 1)")
    p.add_argument("--rounds", type=int, default=2, help="alternated steady rounds after each side's first")
    p.add_argument("--update-prompts", type=int, default=None, help="prompts of the update batch (default recipe)")
    p.add_argument("--updates", type=int, default=2, help="steady updates after the first")
    p.add_argument("--pipeline-iterations", type=int, default=3)
    p.add_argument("--pipeline-set", action="append", default=[], metavar="KEY=VALUE", help="more --set for part 3")
    p.add_argument("--pipeline-timeout-s", type=float, default=3600)
    p.add_argument("--skip-rollout", action="store_true")
    p.add_argument("--skip-update", action="store_true")
    p.add_argument("--skip-pipeline", action="store_true")
    p.add_argument("--run-dir", default=None, help="a finished recipe run (default ./runs/real-arithmetic)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core allowed)")
    p.add_argument("--results-dir", default=None, help="where the line is appended (default bench/results)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
    a = parse(argv)
    user_env = dict(os.environ)  # the pipeline subprocess runs as a user's `ppoflow train` would
    import torch

    cores = sorted(os.sched_getaffinity(0))
    threads = a.threads or len(cores)
    torch.set_num_threads(threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores[:threads])))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    figures: dict = {"model": MODEL_NAME, "recipe": str(RECIPE.relative_to(REPO)), "torch_threads": threads}
    figures["vllm_cpu_threads_bind"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    with tempfile.TemporaryDirectory(prefix="ppoflow-bench-real-data-") as data_root:
        if not a.skip_rollout:
            cfg = recipe(Path(data_root))
            prompts, seeds = recipe_prompts(cfg, a.prompts)
            figures.update(measure_rollout(cfg, prompts, seeds, a.new_tokens, a.rounds))
        if not a.skip_update:
            overrides = []
            if a.update_prompts:  # a smaller batch: train and micro batches cut to fit it
                base = recipe(Path(data_root))
                rows = a.update_prompts * base.rollout.n_samples
                train_batch = min(base.train.train_batch_size or rows, rows)
                micro = min(base.train.micro_batch_size, train_batch)
                overrides = [f"rollout.prompts_per_iteration={a.update_prompts}"]
                overrides += [f"train.train_batch_size={train_batch}", f"train.micro_batch_size={micro}"]
            figures.update(measure_update(recipe(Path(data_root), overrides), a.updates))
    if not a.skip_pipeline:
        figures.update(measure_pipeline(a.pipeline_iterations, a.pipeline_set, user_env, a.pipeline_timeout_s))
        steady_update = figures.get("pipeline_steady_s", {}).get("update")
        if steady_update and "update_steady_s" in figures and not a.update_prompts and not a.pipeline_set:
            figures["pipeline_update_over_bare_update"] = round(steady_update / figures["update_steady_s"], 2)
    run_dir = Path(a.run_dir) if a.run_dir else REPO / "runs" / "real-arithmetic"
    if (run_dir / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        accuracy = accuracy_figures(rows)
        if accuracy:
            figures.update({"accuracy_run_dir": str(run_dir), **accuracy})
    return emit("real_model", figures, Path(a.results_dir) if a.results_dir else None)


if __name__ == "__main__":  # required: vLLM's engine core runs in a spawned process
    main()
