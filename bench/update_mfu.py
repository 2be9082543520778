"""The DeepSpeed PPO update on a GPU: tokens/s and model-FLOPs utilisation (MFU) of the real PPOTrainer.

    python -m bench.update_mfu                              # GPU: a ~0.47B random Llama in bf16 (goal MFU >= 40%)
    python -m bench.update_mfu --size tiny --device cpu     # the same code path on CPU (no MFU: no peak known)

What runs: `PPOTrainer.update` (engines/trainer/ppo_trainer.py) on a synthetic experience batch, actor and
critic as DeepSpeed engines (ZeRO stage 0, one rank), exactly as the update stage calls it; nothing of
Prefect or storage. Batch: `--batch` rows of `--prompt-len` prompt tokens and `--response-len` response
tokens (random ids, no padding, so every token is real work), `--epochs` PPO epochs of one optimizer step
over the whole batch in `--micro-batch` micro-batches. One untimed warm-up update, then `--updates` timed
ones (CUDA synchronised), median seconds.

Precision, the same recipe on GPU and CPU: float32 weights, gradients and AdamW state, every forward and
backward under torch.autocast(bfloat16) (`model.autocast_dtype`), so matmuls run on bf16 tensor cores. Not
DeepSpeed's own `bf16` mode: with ZeRO stage 0 DeepSpeed 0.19 trains bf16 weights with a bf16 optimizer and
no fp32 master copy (it dropped the fp32-accumulation fallback without ZeRO), which no PPO user wants.
Attention: SDPA on GPU (flash kernels), eager on CPU (faster for short sequences there).

Named baseline (same run, same model and tokens): `plain_step`, a bare causal-LM training step of the
actor alone -- forward, cross-entropy over all tokens, backward, torch AdamW(fused) -- with no DeepSpeed,
no critic and no PPO math. `update_over_plain` = (PPO update tokens/s) / (plain-step tokens/s); each PPO
epoch trains two models (actor and critic), so ~0.5 means no overhead beyond the second model.

FLOPs (model FLOPs, the PaLM appendix B convention: no recomputation counted, causal attention not halved):
a forward+backward pass over T tokens of sequence length S costs 6 * N_body * T + 12 * L * d * S * T, with
N_body = transformer-layer parameters, L = layers, d = hidden size. Counted is the work the update needs,
which is what ppoflow runs (engines/trainer/forward.py): the input is P + R - 1 columns (the last response
token predicts nothing scored), and the last layer's MLP and the actor's LM head (d * V) run on the R
response columns only; the critic's value head (d parameters) is ignored. Old log-probs and values come
from the first epoch's own forward when one micro-batch holds the whole batch; otherwise one forward of
each model more (a third of a forward+backward).
MFU = FLOPs / seconds / peak, peak = the GPU's dense bf16 peak (H100/H200 SXM: 989.4 TFLOP/s); None on CPU
or an unknown GPU. Figures also give the peak memory allocated (GPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bench.common import emit

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int


SIZES = {
    # ~0.47B parameters: 24 layers x 16.8M + untied embedding and LM head of 32000 x 1024 each.
    "0.5b": ModelSize(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096, vocab_size=32000),
    # the peer benchmark's small Llama (bench/peer_trl.py), for a CPU run of the same code path
    "tiny": ModelSize(hidden_size=512, num_layers=3, num_heads=8, intermediate_size=1536, vocab_size=64),
}


def layer_params(size: ModelSize) -> int:
    """Parameters of one Llama decoder layer: q, k, v, o (d x d each, no bias), gate/up/down MLP, two RMSNorms."""
    d, f = size.hidden_size, size.intermediate_size
    return 4 * d * d + 3 * d * f + 2 * d


def update_flops(
    size: ModelSize, batch: int, prompt_len: int, response_len: int, epochs: int, old_from_first_forward: bool
) -> float:
    """Model FLOPs of one PPO update (actor + critic), the convention of the module docstring."""
    seq = prompt_len + response_len - 1
    tokens = batch * seq
    d, f = size.hidden_size, size.intermediate_size
    body = (
        6 * size.num_layers * layer_params(size) * tokens
        + 12 * size.num_layers * d * seq * tokens
        - 6 * 3 * d * f * batch * (seq - response_len)
    )  # last layer's MLP: response columns only
    head = 6 * d * size.vocab_size * batch * response_len
    train_pass = (body + head) + body  # actor, critic
    extra_forward = 0 if old_from_first_forward else train_pass / 3  # a forward is a third of forward+backward
    return epochs * train_pass + extra_forward


def plain_step_flops(size: ModelSize, batch: int, seq: int) -> float:
    """Model FLOPs of one causal-LM training step of the actor: every position through the LM head."""
    tokens = batch * seq
    return (
        6 * size.num_layers * layer_params(size) * tokens
        + 12 * size.num_layers * size.hidden_size * seq * tokens
        + 6 * size.hidden_size * size.vocab_size * tokens
    )


def peak_flops(device: str) -> Optional[float]:
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def build_model_dir(size: ModelSize, seq: int, work: Path) -> Path:
    from engines.toy.model import build_tiny_llama

    folder = work / f"llama-{size.hidden_size}x{size.num_layers}-v{size.vocab_size}"
    if not (folder / "config.json").exists():
        build_tiny_llama(
            folder,
            vocab_size=size.vocab_size,
            hidden_size=size.hidden_size,
            num_layers=size.num_layers,
            num_heads=size.num_heads,
            intermediate_size=size.intermediate_size,
            max_position_embeddings=max(256, seq),
        )
    return folder


def synthetic_batch(size: ModelSize, batch: int, prompt_len: int, response_len: int, seed: int = 0):
    """An ExperienceBatch of random tokens (ids >= 4: no pad, BOS, EOS or UNK), rewards and log-probs."""
    import torch

    from engines.trainer.experience import ExperienceBatch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, size.vocab_size, (batch, prompt_len), generator=g).tolist()
    response = torch.randint(4, size.vocab_size, (batch, response_len), generator=g).tolist()
    logprobs = (-torch.rand(batch, response_len, generator=g) * 5).tolist()
    scores = torch.rand(batch, generator=g).tolist()
    return ExperienceBatch.from_lists(prompt, response, scores, logprobs, rollout_logprobs=logprobs, pad_token_id=0)


def attention(device: str) -> str:
    return "sdpa" if device == "cuda" else "eager"


def make_config(model_dir: Path, device: str, batch: int, micro_batch: int, epochs: int, response_len: int):
    from ppoflow.config import load_config

    precision = [
        "model.dtype=float32",
        "model.autocast_dtype=bfloat16",
        f"model.attn_implementation={attention(device)}",
    ]
    return load_config(
        None,
        [
            f"model.policy_path={model_dir}",
            "algo.name=ppo",
            f"rollout.prompts_per_iteration={batch}",
            "rollout.n_samples=1",
            f"rollout.max_new_tokens={response_len}",
            f"train.ppo_epochs={epochs}",
            f"train.train_batch_size={batch}",
            f"train.micro_batch_size={micro_batch}",
            "train.zero_stage=0",
            "train.lr_schedule=constant",
            "train.warmup_steps=0",
            *precision,
        ],
    )


def time_ppo_update(cfg, model_dir: Path, batch_data, device: str, updates: int) -> tuple[list[float], bool]:
    """Seconds of each timed update (after one warm-up) and whether old log-probs came from the first forward."""
    from engines.trainer.ppo_trainer import PPOTrainer

    trainer = PPOTrainer(cfg, str(model_dir))
    reuse = trainer._old_from_first_forward(batch_data)
    trainer.update(batch_data)
    _sync(device)
    seconds = []
    for _ in range(updates):
        start = time.perf_counter()
        trainer.update(batch_data)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    del trainer
    return seconds, reuse


def time_plain_step(model_dir: Path, batch_data, device: str, autocast_dtype: Optional[str], steps: int) -> list[float]:
    """Seconds of each timed bare training step of the actor (module docstring), after one warm-up."""
    import torch

    from engines.models import autocast, load_policy

    model = load_policy(str(model_dir), "float32", attention(device)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.cat([batch_data.prompt_ids, batch_data.response_ids], dim=1).to(device)
    seconds = []
    for step in range(steps + 1):
        start = time.perf_counter()
        with autocast(autocast_dtype, device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step:
            seconds.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--batch", type=int, default=None, help="rows per update (default 32 on GPU, 16 on CPU)")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (default: --batch)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 on GPU, 16 on CPU")
    p.add_argument("--response-len", type=int, default=None, help="default 256 on GPU, 8 on CPU")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--work-dir", default=None, help="where the model folder is built (default: a temp folder)")
    a = p.parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    gpu = device == "cuda"
    batch = a.batch or (32 if gpu else 16)
    micro = a.micro_batch or batch
    prompt_len, response_len = a.prompt_len or (256 if gpu else 16), a.response_len or (256 if gpu else 8)
    size = SIZES[a.size]
    # A folder made here is removed afterwards (the 0.47B model is ~1.9 GB); a --work-dir is the caller's.
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="ppoflow-bench-mfu-"))
    try:
        model_dir = build_model_dir(size, prompt_len + response_len, work)
        data = synthetic_batch(size, batch, prompt_len, response_len)
        cfg = make_config(model_dir, device, batch, micro, a.epochs, response_len)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        ppo_s, reuse = time_ppo_update(cfg, model_dir, data, device, a.updates)
        ppo_peak_mem = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
        plain_s = time_plain_step(model_dir, data, device, cfg.model.autocast_dtype, a.updates)
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    tokens = batch * (prompt_len + response_len)
    ppo_flops = update_flops(size, batch, prompt_len, response_len, a.epochs, reuse)
    plain_flops = plain_step_flops(size, batch, prompt_len + response_len)
    ppo_med, plain_med = statistics.median(ppo_s), statistics.median(plain_s)
    peak = peak_flops(device)
    params = size.num_layers * layer_params(size) + 2 * size.vocab_size * size.hidden_size + size.hidden_size
    figures = {
        "size": a.size,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "params": params,
        "batch": batch,
        "micro_batch": micro,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "epochs": a.epochs,
        "precision": "float32 weights + bfloat16 autocast",
        "baseline": "plain_step: bare causal-LM step of the actor alone (torch AdamW, no DeepSpeed, no critic)",
        "old_from_first_forward": reuse,
        "update_s": round(ppo_med, 6),
        "plain_step_s": round(plain_med, 6),
        # tokens trained per second: each of the batch's tokens passes through actor and critic `epochs` times
        "update_tokens_per_s": round(tokens * a.epochs / ppo_med, 1),
        "plain_tokens_per_s": round(tokens / plain_med, 1),
        "update_over_plain": round((tokens * a.epochs / ppo_med) / (tokens / plain_med), 3),
        "update_tflops": round(ppo_flops / ppo_med / 1e12, 3),
        "plain_tflops": round(plain_flops / plain_med / 1e12, 3),
        "mfu": round(ppo_flops / ppo_med / peak, 4) if peak else None,
        "plain_mfu": round(plain_flops / plain_med / peak, 4) if peak else None,
        "mfu_goal": 0.40,
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_mem_gib": round(ppo_peak_mem, 2) if ppo_peak_mem is not None else None,
    }
    return emit("update_mfu", figures)


if __name__ == "__main__":
    main()
