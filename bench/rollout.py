"""Rollout throughput: ppoflow's vLLM engine vs. Hugging Face `generate` (the named baseline), one run.

    python -m bench.rollout [--model tiny|small|medium] [--prompts 256] [--new-tokens 64] [--repeats 2]

Setup: a random-init Llama from engines/toy/model.py (vocab 64, head_dim 64, fp32) of the chosen size
(tiny: hidden 128, 2 layers, the toy task's model; small: hidden 512, 3 layers, peer_trl's small model;
medium: hidden 1024, 8 layers, ~100 M parameters), the
same prompts (the first N digits-task prompts, tokenized) and the same lengths for both: every sample
generates exactly --new-tokens tokens (vLLM: ignore_eos + min_tokens; HF: min_new_tokens), n = 1,
temperature 1, no top-p/top-k. HF generate gets the whole batch at once (left padding, SDPA, KV cache);
vLLM gets all prompts in one `generate` call. Each side is warmed up first (a small call, excluded);
then the best of --repeats timed runs counts. Also reported: vLLM's start-up and a weight reload
(`load_weights`, what an iteration pays instead of a restart).

Cores: vLLM's CPU build binds its worker to all cores but one by default (the one is reserved for the
calling process); here both sides get every core this process may use (VLLM_CPU_OMP_THREADS_BIND and
VLLM_CPU_NUM_OF_RESERVED_CPU are set unless already set), as HF generate's torch threads do.

Figures: generated tokens per second for each side and their ratio vllm/hf (goal >= 5).
Ends with one JSON line (bench/common.py emit), appended to bench/results/rollout.jsonl.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.common import emit


def digits_prompt_ids(model_dir: Path, count: int) -> list[list[int]]:
    """Token ids of the first `count` digits-task prompts (BOS included by the tokenizer)."""
    from transformers import AutoTokenizer

    from engines.toy.task import make_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p)["input_ids"] for p in make_rows(count, seed=0)["prompt"]]


def time_vllm(model_dir: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    from engines.rollout.base import SamplingSettings
    from engines.rollout.vllm_engine import VLLMRolloutEngine

    started = time.perf_counter()
    engine = VLLMRolloutEngine(str(model_dir), kv_cache_space_gib=1.0, max_model_len=256)
    startup_s = time.perf_counter() - started
    try:
        sampling = SamplingSettings(n=1, max_new_tokens=new_tokens)
        engine.generate(prompts[:16], sampling, ignore_eos=True)  # warm-up, excluded
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            samples = engine.generate(prompts, sampling, ignore_eos=True)
            best = min(best, time.perf_counter() - t0)
        tokens = sum(len(s.response_ids) for s in samples)
        t0 = time.perf_counter()
        engine.load_weights(str(model_dir), 1)
        reload_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return {"tokens": tokens, "seconds": best, "startup_s": startup_s, "reload_s": reload_s}


def time_hf(model_dir: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # padding_side="left" is saved with it
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")

    def run(b) -> int:
        with torch.no_grad():
            out = model.generate(
                **b,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        return (out.shape[1] - b["input_ids"].shape[1]) * out.shape[0]

    run({k: v[:16] for k, v in batch.items()})  # warm-up, excluded
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = run(batch)
        best = min(best, time.perf_counter() - t0)
    return {"tokens": tokens, "seconds": best}


MODELS = {  # build_tiny_llama keyword arguments per --model
    "tiny": {},
    "small": {"hidden_size": 512, "num_heads": 8, "num_layers": 3, "intermediate_size": 1536},
    "medium": {"hidden_size": 1024, "num_heads": 16, "num_layers": 8, "intermediate_size": 2816},
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    from engines.toy.model import build_tiny_llama

    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "llama", seed=0, **MODELS[a.model])
        prompts = digits_prompt_ids(model_dir, a.prompts)
        vllm = time_vllm(model_dir, prompts, a.new_tokens, a.repeats)
        hf = time_hf(model_dir, prompts, a.new_tokens, a.repeats)
    expected = a.prompts * a.new_tokens
    if vllm["tokens"] != expected or hf["tokens"] != expected:
        raise RuntimeError(f"unequal work: vllm generated {vllm['tokens']}, hf {hf['tokens']}, expected {expected}")
    vllm_tps, hf_tps = vllm["tokens"] / vllm["seconds"], hf["tokens"] / hf["seconds"]
    print(f"vLLM {vllm_tps:,.0f} tok/s  HF generate {hf_tps:,.0f} tok/s  ratio {vllm_tps / hf_tps:.2f}x (goal >= 5x)")
    return emit(
        "rollout",
        {
            "baseline": "transformers generate (batched, sdpa, fp32)",
            "model": a.model,
            "model_config": MODELS[a.model] or "hidden 128, 2 layers",
            "prompts": a.prompts,
            "new_tokens": a.new_tokens,
            "generated_tokens": expected,
            "vllm_tokens_per_s": round(vllm_tps, 1),
            "hf_tokens_per_s": round(hf_tps, 1),
            "ratio_vllm_over_hf": round(vllm_tps / hf_tps, 2),
            "goal_ratio": 5.0,
            "vllm_startup_s": round(vllm["startup_s"], 1),
            "vllm_reload_weights_s": round(vllm["reload_s"], 3),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "vllm_cpu_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        },
    )


if __name__ == "__main__":  # required: vLLM's engine core runs in a spawned process
    main()
