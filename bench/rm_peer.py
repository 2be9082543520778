"""ppoflow reward-model training against TRL's RewardTrainer: seconds per optimizer step and eval accuracy, one run.

    python -m bench.rm_peer                    # 4000 toy pairs (10% held out), 1 epoch, batch 32
    python -m bench.rm_peer --pairs 1000       # quicker

Same work on every side: the tiny Llama built here (engines/toy/model.py) with a new one-label score head,
the toy preference pairs (engines/toy/preferences.py), tokenized once by ppoflow (engines/rm/data.py) and
handed to TRL as token ids, batch 32 pairs per optimizer step, the same epochs, AdamW lr 1e-3, linear
warm-up 5 steps then cosine, clipping 1.0, seed 0. Sides, each a fresh process with one CPU thread, in turn:
    ppoflow_engine       engines/rm/trainer.RMTrainer (DeepSpeed ZeRO stage 0) with ppoflow's CPU settings
                         (bench/ppoflow_side.py's choice for the PPO peer bench: bfloat16 autocast, eager
                         attention; weights and AdamW state float32), no Prefect. On a CPU without bfloat16
                         matmul kernels (engines/precision.py; AVX2 only: emulated, ~16x slower, refused by
                         preflight) float32 without autocast instead: ppoflow_engine then differs from
                         ppoflow_engine_fp32 in the attention only, and ratio_same_precision_bf16 compares
                         ppoflow in float32 with TRL in bfloat16
    trl_reward           TRL 1.16 RewardTrainer as it runs by default (float32, SDPA), in its own venv
                         (bench/trl_env.py, bench/trl_side/rm_trl.py)
    ppoflow_engine_fp32  ppoflow in float32 with SDPA: TRL's precision
    trl_reward_bf16      TRL with bf16=True (bfloat16 autocast on CPU): ppoflow's precision
    ppoflow_flow         `ppoflow train-rm` with the CPU settings (the Prefect flow: units, checkpoints,
                         metrics, export); its step time is timing/step of metrics.jsonl (the units'
                         training loops), flow_wall_s the whole command (Prefect's local server start included)
Figures: ratio = ppoflow_engine / trl_reward seconds per step (the peer number, as bench.peer_trl's; goal
<= 0.7), ratio_same_precision_fp32 = ppoflow_engine_fp32 / trl_reward, ratio_same_precision_bf16 =
ppoflow_engine / trl_reward_bf16, flow_ratio = ppoflow_flow / trl_reward; the eval accuracy of every side on
the same held-out pairs (goal: ppoflow >= TRL). One run each on a shared machine: figures are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit
from bench.peer_trl import parse_records
from engines.precision import cpu_bf16

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / ".work" / "rm_peer"
_ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DS_ACCELERATOR": "cpu",
    "CUDA_VISIBLE_DEVICES": "",
    "PYTHONPATH": str(REPO_ROOT),
}
SETTINGS = {"batch_size": 32, "micro_batch_size": 32, "lr": 1e-3, "warmup_steps": 5, "seed": 0}
# The model section's; bfloat16 autocast only where the CPU has bfloat16 matmul kernels (module docstring).
CPU_SETTINGS = {"autocast_dtype": "bfloat16" if cpu_bf16().kernels else None, "attn_implementation": "eager"}
FP32_SETTINGS = ["--set", "model.autocast_dtype=null", "--set", "model.attn_implementation=sdpa"]


def config_data(model_dir: Path, data_path: Path, epochs: int, run: str, root: Path) -> dict:
    """The ppoflow config (as a dict) of the ppoflow sides (ppoflow_engine_fp32 overrides the model settings)."""
    return {
        "run": {"name": run, "root": str(root), "seed": SETTINGS["seed"]},
        "model": {"policy_path": str(model_dir), **CPU_SETTINGS},
        "train": {
            "zero_stage": 0,
            "warmup_steps": SETTINGS["warmup_steps"],
            "lr_schedule": "cosine",
            "max_grad_norm": 1.0,
        },
        "rm_train": {
            "data_path": str(data_path),
            "eval_fraction": 0.1,
            "epochs": epochs,
            "batch_size": SETTINGS["batch_size"],
            "micro_batch_size": SETTINGS["micro_batch_size"],
            "lr": SETTINGS["lr"],
        },
        "pipeline": {"retries": 0, "retry_delay_s": 0},
    }


def engine_side(config_path: str, overrides: list[str]) -> None:
    """Run in a child: RMTrainer over every step, then the eval accuracy; prints the final record."""
    import torch

    from bench.trl_side.common import emit_record
    from engines.models import load_tokenizer
    from engines.rm.data import load_preferences
    from engines.rm.trainer import RMTrainer
    from ppoflow.config import load_config

    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg = load_config(config_path, overrides)
    data = load_preferences(cfg.rm_train, load_tokenizer(cfg.model.policy_path), cfg.run.seed)
    trainer = RMTrainer(cfg, data, cfg.model.policy_path)
    setup_s = time.perf_counter() - started
    train_started = time.perf_counter()
    metrics = trainer.train_steps(trainer.total_steps)
    train_s = time.perf_counter() - train_started
    emit_record(
        "final",
        trainer="ppoflow_engine",
        steps=trainer.total_steps,
        setup_s=setup_s,
        train_s=train_s,
        step_s=train_s / trainer.total_steps,
        train_loss=metrics["rm/loss"],
        eval_accuracy=trainer.evaluate()["rm/eval_accuracy"],
    )


def _run(argv: list[str], timeout_s: float, env: dict | None = None) -> dict:
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            argv,
            cwd=REPO_ROOT,
            env={**os.environ, **_ONE_THREAD, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout_s} s"}
    wall_s = time.perf_counter() - started
    _, final = parse_records(proc.stdout)
    if proc.returncode != 0:
        return {"ok": False, "error": f"rc {proc.returncode}: {proc.stderr[-1500:]}", "wall_s": wall_s}
    return {"ok": True, "wall_s": wall_s, **(final or {})}


def flow_side(config_path: Path, root: Path, run: str, timeout_s: float) -> dict:
    """`ppoflow train-rm` against a Prefect home of its own; step time from metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="rm_peer_prefect_") as home:
        env = {"PREFECT_HOME": home, "PREFECT_API_URL": ""}
        result = _run([sys.executable, "-m", "cli", "train-rm", str(config_path)], timeout_s, env)
    if not result["ok"]:
        return result
    rows = [json.loads(line) for line in (root / run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = rows[-1]["rm/step"]
    summary = json.loads((root / run / "reward_model" / "rm_train.json").read_text())
    starts = [0] + [r["rm/step"] for r in rows[:-1]]
    train_s = sum(r["timing/step"] * (r["rm/step"] - s) for r, s in zip(rows, starts))
    return {
        "ok": True,
        "steps": steps,
        "step_s": train_s / steps,
        "flow_wall_s": result["wall_s"],
        "eval_accuracy": summary["eval"]["rm/eval_accuracy"],
        "train_loss": rows[-1]["rm/loss"],
    }


def _ratio(a: dict, b: dict) -> float | None:
    return a["step_s"] / b["step_s"] if a.get("ok") and b.get("ok") and b.get("step_s") else None


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--side", choices=["engine"], help=argparse.SUPPRESS)  # internal: one ppoflow child
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side == "engine":
        engine_side(a.config, a.set)
        return None
    import yaml

    from bench.trl_env import ensure_venv
    from engines.models import load_tokenizer
    from engines.rm.data import load_preferences
    from engines.toy.model import ensure_tiny_llama
    from engines.toy.preferences import build_preferences
    from ppoflow.config import build_config

    model_dir = ensure_tiny_llama(WORK_DIR / "models" / "tiny")
    data_path = build_preferences(WORK_DIR / f"pairs-{a.pairs}.jsonl", num_pairs=a.pairs, seed=0)
    root = Path(tempfile.mkdtemp(prefix="rm_peer_runs_"))
    config_path = WORK_DIR / "config.yaml"
    config_path.write_text(yaml.safe_dump(config_data(model_dir, data_path, a.epochs, "rm-peer", root)))
    cfg = build_config(yaml.safe_load(config_path.read_text()), str(config_path))
    data = load_preferences(cfg.rm_train, load_tokenizer(model_dir), cfg.run.seed)
    tokens_path = WORK_DIR / "tokens.json"
    sides_of = lambda pairs: {"chosen_ids": pairs.chosen_ids, "rejected_ids": pairs.rejected_ids}  # noqa: E731
    tokens_path.write_text(
        json.dumps(
            {
                "pad_token_id": load_tokenizer(model_dir).pad_token_id,
                "train": sides_of(data.train),
                "eval": sides_of(data.eval),
            }
        )
    )
    engine = [sys.executable, "-m", "bench.rm_peer", "--side", "engine", "--config", str(config_path)]
    trl = [
        str(ensure_venv("trl-grpo")),
        str(REPO_ROOT / "bench" / "trl_side" / "rm_trl.py"),
        "--model",
        str(model_dir),
        "--tokens",
        str(tokens_path),
        "--seed",
        str(SETTINGS["seed"]),
        "--epochs",
        str(a.epochs),
        "--batch-size",
        str(SETTINGS["batch_size"]),
        "--micro-batch-size",
        str(SETTINGS["micro_batch_size"]),
        "--lr",
        str(SETTINGS["lr"]),
        "--warmup-steps",
        str(SETTINGS["warmup_steps"]),
    ]
    sides = {}
    for name, run in (
        ("ppoflow_engine", lambda: _run(engine, a.timeout)),
        ("trl_reward", lambda: _run(trl, a.timeout)),
        ("ppoflow_engine_fp32", lambda: _run(engine + FP32_SETTINGS, a.timeout)),
        ("trl_reward_bf16", lambda: _run(trl + ["--bf16"], a.timeout)),
        ("ppoflow_flow", lambda: flow_side(config_path, root, "rm-peer", a.timeout)),
    ):
        sides[name] = run()
        print(f"# {name}: {json.dumps(sides[name])[:400]}", file=sys.stderr, flush=True)
    figures = {
        "pairs": a.pairs,
        "train_pairs": len(data.train),
        "eval_pairs": len(data.eval),
        "epochs": a.epochs,
        **SETTINGS,
        "threads_per_process": 1,
        "model": "tiny Llama (engines/toy/model.py defaults)",
        "ppoflow_settings": CPU_SETTINGS,
        "ratio": _ratio(sides["ppoflow_engine"], sides["trl_reward"]),
        "ratio_same_precision_fp32": _ratio(sides["ppoflow_engine_fp32"], sides["trl_reward"]),
        "ratio_same_precision_bf16": _ratio(sides["ppoflow_engine"], sides["trl_reward_bf16"]),
        "flow_ratio": _ratio(sides["ppoflow_flow"], sides["trl_reward"]),
        **{f"{name}_eval_accuracy": side.get("eval_accuracy") for name, side in sides.items()},
        "sides": sides,
        "note": "one run per side on a machine shared with other work: figures are noisy",
    }
    return emit("rm_peer", figures)


if __name__ == "__main__":
    main()
