"""The DeepSpeed PPO update on a GPU: tokens/s and model-FLOPs utilisation (MFU) of the real PPOTrainer.

    python -m bench.update_mfu                              # GPU: a ~0.47B random Llama in bf16 (goal MFU >= 40%)
    python -m bench.update_mfu --size tiny --device cpu     # the same code path on CPU (no MFU: no peak known)

What runs: `PPOTrainer.update` (engines/trainer/ppo_trainer.py) on a synthetic experience batch, actor and
critic as DeepSpeed engines (ZeRO stage 0, one rank), exactly as the update stage calls it; nothing of
Prefect or storage. Batch: `--batch` rows of `--prompt-len` prompt tokens and `--response-len` response
tokens (random ids, no padding, so every token is real work), `--epochs` PPO epochs of one optimizer step
over the whole batch in `--micro-batch` micro-batches. One untimed warm-up update, then `--updates` timed
ones (CUDA synchronised), median seconds.

Precision (`--precision`, default: what `model.dtype` picks on this machine, `ppoflow.config.default_model_dtype`):
- `bf16` (the GPU default): bfloat16 weights and gradients, float32 master weights, gradient accumulation and
  AdamW state inside DeepSpeed's ZeRO-2 optimizer (`deepspeed_config`); no cast per forward.
- `autocast`: float32 weights, gradients and AdamW state, every forward and backward under
  torch.autocast(bfloat16) (ZeRO stage 0); the GPU recipe before bf16 weights, kept as the comparison.
- `fp32`: float32 throughout (the CPU default; CPUs here have no bfloat16 matmul kernels).
Attention: SDPA on GPU (flash kernels), eager on CPU (faster for short sequences there).

Algorithms (`--algo`): `ppo` trains actor and critic (GAE); `grpo` trains the actor alone (groups of
`--group` rows; their prompts are distinct random tokens, so no row shares its prompt's columns with another
and every row runs its full P + R - 1 columns: the FLOP count below holds). For `ppo` the critic engine's
forward, backward and step are timed apart (CUDA events around its calls) and the actor's MFU is its FLOPs
over the rest of the update's time (everything that is not the critic is charged to the actor).

`--profile`: one more update under torch.profiler; the figures gain the share of device time in matmul,
attention and other kernels, and the top kernels by time (bench/kernel_shares.py).

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
import functools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import emit
from bench.update_flops import SIZES, ModelSize, layer_params, peak_flops, plain_step_flops, update_flops

__all__ = ["SIZES", "ModelSize", "layer_params", "main", "peak_flops", "plain_step_flops", "update_flops"]


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


PRECISIONS = {
    # name: (model.dtype, model.autocast_dtype, train.zero_stage)
    "bf16": ("bfloat16", None, 2),
    "autocast": ("float32", "bfloat16", 0),
    "fp32": ("float32", None, 0),
}


def default_precision() -> str:
    """The precision `model.dtype` picks on this machine when unset: bf16 on a GPU, fp32 elsewhere."""
    from ppoflow.config import default_model_dtype

    return "bf16" if default_model_dtype() == "bfloat16" else "fp32"


def synthetic_batch(size: ModelSize, batch: int, prompt_len: int, response_len: int, group: int = 1, seed: int = 0):
    """An ExperienceBatch of random tokens (ids >= 4: no pad, BOS, EOS or UNK), rewards and log-probs; rows
    in groups of `group` consecutive rows (GRPO's groups; every row's prompt is its own random tokens)."""
    import torch

    from engines.trainer.experience import ExperienceBatch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, size.vocab_size, (batch, prompt_len), generator=g).tolist()
    response = torch.randint(4, size.vocab_size, (batch, response_len), generator=g).tolist()
    logprobs = (-torch.rand(batch, response_len, generator=g) * 5).tolist()
    scores = torch.rand(batch, generator=g).tolist()
    groups = [row // group for row in range(batch)]
    return ExperienceBatch.from_lists(
        prompt, response, scores, logprobs, rollout_logprobs=logprobs, group_ids=groups, pad_token_id=0
    )


def attention(device: str) -> str:
    return "sdpa" if device == "cuda" else "eager"


def make_config(
    model_dir: Path,
    device: str,
    batch: int,
    micro_batch: int,
    epochs: int,
    response_len: int,
    precision: str,
    algo: str,
):
    from ppoflow.config import load_config

    dtype, autocast_dtype, stage = PRECISIONS[precision]
    group = 4 if algo == "grpo" else 1
    return load_config(
        None,
        [
            f"model.policy_path={model_dir}",
            f"algo.name={algo}",
            f"rollout.prompts_per_iteration={batch // group}",
            f"rollout.n_samples={group}",
            f"rollout.max_new_tokens={response_len}",
            f"train.ppo_epochs={epochs}",
            f"train.train_batch_size={batch}",
            f"train.micro_batch_size={micro_batch}",
            f"train.zero_stage={stage}",
            "train.lr_schedule=constant",
            "train.warmup_steps=0",
            f"model.dtype={dtype}",
            f"model.autocast_dtype={'null' if autocast_dtype is None else autocast_dtype}",
            f"model.attn_implementation={attention(device)}",
        ],
    )


class EngineClock:
    """Device seconds inside one DeepSpeed engine's forward, backward and step calls, from outside the trainer:
    the engine's bound methods are replaced on this instance by timed ones (CUDA events on a GPU, so the time
    is the device's; perf_counter on CPU, where the calls are synchronous)."""

    def __init__(self, engine, device: str):
        self.device = device
        self.intervals: list = []
        for name in ("forward", "backward", "step"):
            setattr(engine, name, self._timed(getattr(engine, name)))

    def _timed(self, call):
        import torch

        def timed(*args, **kwargs):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = call(*args, **kwargs)
                end.record()
                self.intervals.append((start, end))
            else:
                began = time.perf_counter()
                out = call(*args, **kwargs)
                self.intervals.append(time.perf_counter() - began)
            return out

        return timed

    def seconds(self) -> float:
        """Seconds recorded so far (synchronise the device first), then forget them."""
        total = sum(i if isinstance(i, float) else i[0].elapsed_time(i[1]) / 1e3 for i in self.intervals)
        self.intervals.clear()
        return total


def compile_layers(engine) -> int:
    """Experiment: torch.compile (in place) every decoder layer of the model behind a DeepSpeed engine but the
    last, whose MLP the trainer trims with hooks per forward (engines/trainer/forward.py). Returns how many."""
    from engines.trainer.forward import _unwrap

    base = _unwrap(engine)
    decoder = getattr(base, "model", base)
    layers = list(decoder.layers)[:-1]
    for layer in layers:
        layer.compile()
    return len(layers)


def time_update(
    cfg, model_dir: Path, batch_data, device: str, updates: int, profile: bool, compile_layers_too: bool = False
) -> dict:
    """Each timed update's seconds (after one warm-up), the critic's share of them, whether old log-probs came
    from the first forward, and (with `profile`) the kernel shares of one more update."""
    from bench.kernel_shares import profile_shares
    from engines.trainer.ppo_trainer import PPOTrainer

    trainer = PPOTrainer(cfg, str(model_dir))
    if compile_layers_too:
        for engine in (trainer.actor, trainer.critic):
            if engine is not None:
                compile_layers(engine)
    reuse = trainer._old_from_first_forward(batch_data)
    warm_start = time.perf_counter()
    clock = EngineClock(trainer.critic, device) if trainer.critic is not None else None
    trainer.update(batch_data)
    _sync(device)
    warm_up_s = time.perf_counter() - warm_start
    seconds, critic_seconds = [], []
    for _ in range(updates):
        if clock is not None:
            clock.seconds()
        start = time.perf_counter()
        trainer.update(batch_data)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        critic_seconds.append(clock.seconds() if clock is not None else 0.0)
    shares = profile_shares(functools.partial(trainer.update, batch_data), device) if profile else None
    del trainer
    return {
        "seconds": seconds,
        "critic_seconds": critic_seconds,
        "reuse": reuse,
        "shares": shares,
        "warm_up_s": warm_up_s,
    }


def time_plain_step(model_dir: Path, batch_data, device: str, precision: str, steps: int) -> list[float]:
    """Seconds of each timed bare training step of the actor (module docstring), after one warm-up. bf16: the
    weights and AdamW state in bfloat16 (no master copy: the bare step, not a recipe)."""
    import torch

    from engines.models import autocast, load_policy

    dtype, autocast_dtype, _ = PRECISIONS[precision]
    model = load_policy(str(model_dir), dtype, attention(device)).to(device)
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--algo", choices=["ppo", "grpo"], default="ppo")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default=None, help="default: this machine's")
    p.add_argument("--batch", type=int, default=None, help="rows per update (default 32 on GPU, 16 on CPU)")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (default: --batch)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 on GPU, 16 on CPU")
    p.add_argument("--response-len", type=int, default=None, help="default 256 on GPU, 8 on CPU")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="profile one more update: kernel time shares")
    p.add_argument(
        "--compile-layers", action="store_true", help="experiment: torch.compile every decoder layer but the last"
    )
    p.add_argument("--work-dir", default=None, help="where the model folder is built (default: a temp folder)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    gpu = device == "cuda"
    precision = a.precision or default_precision()
    batch = a.batch or (32 if gpu else 16)
    micro = a.micro_batch or batch
    prompt_len, response_len = a.prompt_len or (256 if gpu else 16), a.response_len or (256 if gpu else 8)
    size = SIZES[a.size]
    # A folder made here is removed afterwards (the 0.47B model is ~1.9 GB); a --work-dir is the caller's.
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="ppoflow-bench-mfu-"))
    try:
        model_dir = build_model_dir(size, prompt_len + response_len, work)
        data = synthetic_batch(size, batch, prompt_len, response_len, group=4 if a.algo == "grpo" else 1)
        cfg = make_config(model_dir, device, batch, micro, a.epochs, response_len, precision, a.algo)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        timed = time_update(cfg, model_dir, data, device, a.updates, a.profile, a.compile_layers)
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
        if gpu:
            torch.cuda.empty_cache()
        plain_s = time_plain_step(model_dir, data, device, precision, a.updates)
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return emit(
        "update_mfu",
        figures(a, size, device, precision, batch, micro, prompt_len, response_len, timed, plain_s, peak_mem),
    )


def figures(a, size, device, precision, batch, micro, prompt_len, response_len, timed, plain_s, peak_mem) -> dict:
    """The JSON line's figures from the measured seconds and the FLOP model."""
    import torch

    gpu = device == "cuda"
    with_critic = a.algo == "ppo"
    tokens = batch * (prompt_len + response_len)
    update_s, plain_med = statistics.median(timed["seconds"]), statistics.median(plain_s)
    critic_s = statistics.median(timed["critic_seconds"])
    flops = update_flops(size, batch, prompt_len, response_len, a.epochs, timed["reuse"], with_critic)
    actor_flops = update_flops(size, batch, prompt_len, response_len, a.epochs, timed["reuse"], with_critic=False)
    plain_flops = plain_step_flops(size, batch, prompt_len + response_len)
    peak = peak_flops(device)
    params = size.num_layers * layer_params(size) + 2 * size.vocab_size * size.hidden_size + size.hidden_size
    models = 2 if with_critic else 1
    shares = timed["shares"] or {}
    return {
        "size": a.size,
        "algo": a.algo,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "params": params,
        "batch": batch,
        "micro_batch": micro,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "epochs": a.epochs,
        "precision": precision,
        "baseline": "plain_step: bare causal-LM step of the actor alone (torch AdamW, no DeepSpeed, no critic)",
        "old_from_first_forward": timed["reuse"],
        "compiled_layers": a.compile_layers,
        # the first update: CUDA/cuBLAS start-up and, with --compile-layers, the compilation
        "first_update_s": round(timed["warm_up_s"], 3),
        "update_s": round(update_s, 6),
        "critic_s": round(critic_s, 6) if with_critic else None,
        "plain_step_s": round(plain_med, 6),
        # tokens trained per second: each of the batch's tokens passes through every trained model `epochs` times
        "update_tokens_per_s": round(tokens * a.epochs / update_s, 1),
        "plain_tokens_per_s": round(tokens / plain_med, 1),
        "update_over_plain": round((tokens * a.epochs * models / update_s) / (tokens / plain_med), 3),
        "update_tflops": round(flops / update_s / 1e12, 3),
        "plain_tflops": round(plain_flops / plain_med / 1e12, 3),
        "mfu": round(flops / update_s / peak, 4) if peak else None,
        # the actor's FLOPs over everything in the update that is not the critic's engine calls
        "actor_mfu": round(actor_flops / (update_s - critic_s) / peak, 4) if peak else None,
        "plain_mfu": round(plain_flops / plain_med / peak, 4) if peak else None,
        "mfu_goal": 0.40,
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_mem_gib": round(peak_mem, 2) if peak_mem is not None else None,
        **{k: shares[k] for k in ("matmul_share", "attention_share", "other_share", "busy_share") if k in shares},
        **({"top_kernels": shares["top"]} if shares else {}),
    }


if __name__ == "__main__":
    main()
