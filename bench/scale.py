"""Scaling the update: peak trainer memory with LoRA, gradient checkpointing and optimizer offload, and the
bytes a rollout engine receives per iteration, each against the full fine-tune at the same batch.

    python -m bench.scale                        # CPU: the peer bench's 10M-parameter Llama (bench/update_mfu "tiny")
    python -m bench.scale --batch 16 --response-len 96

What runs: the real `PPOTrainer` (GRPO: actor only, so LoRA's effect is not diluted by a full-size critic),
ZeRO stage 2 on one rank, `--updates` updates of a synthetic batch (random ids, groups of 4, no padding),
one optimizer step of `--micro-batch` micro-batches each. Each variant runs in its own fresh process(es):
    full        full fine-tune (the baseline every ratio divides by)
    lora        model.lora rank `--lora-rank` on every Linear of the decoder layers (q,k,v,o,gate,up,down)
    gc          full fine-tune + model.gradient_checkpointing
    offload     full fine-tune + train.offload=optimizer (ZeRO-Offload; on a CPU-only machine it moves nothing)
Memory: the process's peak resident set (Linux VmHWM) during trainer build + updates, minus the resident set
just before the build (VmHWM is reset through /proc/self/clear_refs), so imports and the interpreter do not
count: weights, gradients, AdamW state, DeepSpeed's buffers and activations do. Not tracemalloc: torch's
tensors are not allocated through Python's allocator. CPU allocator caching makes this an upper bound.
`state_mib`: the bytes of the actor's parameters plus its optimizer state dict's tensors (fp32 partitions,
AdamW moments), each storage once: the part of the memory that does not depend on the batch.
Bytes to the rollout engine: after one update each variant saves a checkpoint; what a rollout engine reloads
each iteration is the policy folder's weight files (`reload_weights` reads the whole folder): for LoRA the
merged weights, the same size as the full model's. `lora_adapter_bytes` is policy/adapter's safetensors: what
an engine with LoRA support would need instead (ppoflow's engines do not take adapters yet).
    ranks2      the full fine-tune on 2 data-parallel ranks (2 processes, one thread each, gloo): update
                tokens/s against `full` on 1 rank (one thread), and each rank's peak memory (rank 0's)
Tokens/s: response tokens of the batch over the seconds of one update (the second: the first allocates state).

Prints and appends one JSON line to bench/results/scale.jsonl (bench/common.emit).
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

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import emit  # noqa: E402

VARIANTS = {
    "full": {},
    "lora": {"model.lora.target_modules": "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"},
    "gc": {"model.gradient_checkpointing": True},
    "offload": {"train.offload": "optimizer"},
    "ranks2": {},  # the full fine-tune on 2 data-parallel ranks (2 processes, gloo), each training half the rows
}
RANKS = {"ranks2": 2}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _tensor_bytes(obj) -> int:
    """Bytes of the distinct tensors in a nested dict/list (each storage counted once)."""
    import torch

    seen: dict[int, int] = {}

    def walk(x):
        if isinstance(x, torch.Tensor):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return sum(seen.values())


def run_variant(args) -> dict:
    """In a fresh process: build the trainer, run the updates, save; return memory, time and bytes."""
    import torch

    from bench.update_mfu import SIZES, build_model_dir
    from engines.trainer.experience import ExperienceBatch
    from engines.trainer.ppo_trainer import PPOTrainer
    from ppoflow.config import load_config

    torch.set_num_threads(1)
    work = Path(args.work_dir)
    model_dir = build_model_dir(SIZES["tiny"], args.prompt_len + args.response_len, work)
    overrides = {
        "model.policy_path": str(model_dir),
        "algo.name": "grpo",
        "rollout.prompts_per_iteration": args.batch // 4,
        "rollout.n_samples": 4,
        "train.micro_batch_size": args.micro_batch,
        "train.zero_stage": 2,
        "rollout.max_new_tokens": args.response_len,
        "model.attn_implementation": "eager",
        **VARIANTS[args.variant],
    }
    if args.variant == "lora":
        overrides["model.lora.rank"] = args.lora_rank
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    g = torch.Generator().manual_seed(0)
    vocab = 64
    prompt = torch.randint(4, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    response = torch.randint(4, vocab, (args.batch, args.response_len), generator=g).tolist()
    ref = (-torch.rand(args.batch, args.response_len, generator=g) * 5).tolist()
    batch = ExperienceBatch.from_lists(
        prompt,
        response,
        torch.rand(args.batch, generator=g).tolist(),
        ref,
        group_ids=[i // 4 for i in range(args.batch)],
    )
    # Libraries loaded lazily by the build (DeepSpeed, its ops, peft, the Llama code: ~300 MiB of RSS) are loaded
    # first, so the measured increase is the trainer's own memory.
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    from engines.trainer.deepspeed_setup import setup_distributed

    setup_distributed()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status_kib("VmRSS")
    trainer = PPOTrainer(cfg, str(model_dir))
    seconds = []
    for _ in range(args.updates):
        start = time.perf_counter()
        trainer.update(batch)
        seconds.append(time.perf_counter() - start)
    peak = _status_kib("VmHWM")
    out = work / f"checkpoint-{args.variant}"  # the same folder on every rank
    trainer.save(str(out))
    if trainer.actor.global_rank != 0:
        return {}
    state = _tensor_bytes(trainer.actor.optimizer.state_dict()) + _tensor_bytes(
        dict(trainer.actor.module.named_parameters())
    )
    adapter = out / "policy" / "adapter"
    trainable = sum(p.numel() for p in trainer.actor.module.parameters() if p.requires_grad)
    tokens = args.batch * args.response_len
    timed = min(seconds[1:] or seconds)  # the first update also allocates the AdamW state
    return {
        "peak_mib": round((peak - before) / 1024, 1),
        "state_mib": round(state / 2**20, 1),
        "trainable_params": trainable,
        "update_s": round(timed, 3),
        "response_tokens_per_s": round(tokens / timed, 1),
        "engine_bytes": _weight_bytes(out / "policy"),
        "adapter_bytes": _weight_bytes(adapter) if adapter.is_dir() else None,
    }


def _launch(argv: list[str], ranks: int) -> subprocess.CompletedProcess:
    """Run `argv` as `ranks` processes of one DeepSpeed world (RANK/WORLD_SIZE set); rank 0's output back,
    the return code of the first rank that failed."""
    if ranks == 1:
        return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    from engines.trainer.deepspeed_setup import _free_port

    port = str(_free_port())
    procs = [
        subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(ranks)
    ]
    outputs = [p.communicate() for p in procs]
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(argv, code, outputs[0][0], "".join(err for _, err in outputs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=96)
    p.add_argument("--updates", type=int, default=2, help="the first allocates AdamW state; the fastest is timed")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)  # one variant, in this process
    p.add_argument("--work-dir", default=None)
    args = p.parse_args(argv)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-scale-"))
    results = {}
    for variant in VARIANTS:
        argv_child = [
            sys.executable,
            "-m",
            "bench.scale",
            "--variant",
            variant,
            "--work-dir",
            str(work),
            *[
                f"--{k.replace('_', '-')}={getattr(args, k)}"
                for k in ("batch", "micro_batch", "prompt_len", "response_len", "updates", "lora_rank")
            ],
        ]
        done = _launch(argv_child, RANKS.get(variant, 1))
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if done.returncode or line is None:
            results[variant] = {"error": (done.stderr or done.stdout)[-400:]}
            continue
        results[variant] = json.loads(line.removeprefix("RESULT "))
        print(variant, results[variant], flush=True)
    full = results["full"]
    figures = {
        "model": "llama hidden 512 x 3 layers (bench/update_mfu tiny, ~10M params)",
        "algo": "grpo",
        "zero_stage": 2,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "lora_rank": args.lora_rank,
        "memory": "peak RSS increase (VmHWM - RSS before build), MiB",
        "variants": results,
    }
    for variant in ("lora", "gc", "offload"):
        if "peak_mib" in results[variant] and "peak_mib" in full:
            figures[f"memory_{variant}_over_full"] = round(results[variant]["peak_mib"] / full["peak_mib"], 3)
            figures[f"state_{variant}_over_full"] = round(results[variant]["state_mib"] / full["state_mib"], 3)
    if "response_tokens_per_s" in results["ranks2"] and "response_tokens_per_s" in full:
        figures["update_tokens_per_s_2_ranks_over_1"] = round(
            results["ranks2"]["response_tokens_per_s"] / full["response_tokens_per_s"], 3
        )
    if "engine_bytes" in results["lora"] and "engine_bytes" in full:
        figures["engine_bytes_lora_over_full"] = round(results["lora"]["engine_bytes"] / full["engine_bytes"], 4)
        figures["lora_adapter_bytes_over_full"] = round(results["lora"]["adapter_bytes"] / full["engine_bytes"], 4)
    emit("scale", figures)


if __name__ == "__main__":
    main()
