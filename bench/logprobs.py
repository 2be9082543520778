"""Selective log-softmax vs the naive full log-softmax: peak extra memory and time, on CPU.

Run from the repository root:

    python -m bench.logprobs                      # batch 1, seq 1024, vocab 32000, fp32
    python -m bench.logprobs --batch 2 --chunks 64,128,256,512 --repeats 5

Baseline (named, same run): `torch.log_softmax(logits, -1).gather(-1, ids)` -- what TRL/OpenRLHF-style
code writes, materialising a (B, T, V) log-softmax. Candidate: engines.ppo.selective_log_softmax at each
chunk size. Both in forward only and forward + backward (gradient w.r.t. the logits).

How memory is measured, and why this way: each (variant, mode) runs in a FRESH subprocess. It builds
its inputs first (the 131 MB logits, so that the process's peak RSS equals its current RSS), then
runs the op once and reads the peak resident set size (resource.getrusage ru_maxrss) again: the growth
is the extra memory the op touched beyond its inputs, as the OS saw it. This is real on CPU (torch's
CPU allocator returns large blocks to the OS, so nothing is hidden in a cache), counts every temporary
(the ones autograd saves too), and a fresh process per variant stops one variant's freed pages from
hiding another's. The forward + backward figure includes the (B, T, V) gradient of the logits, which
both variants produce -- except selective_log_softmax(inplace_backward=True), which writes it over the
logits. torch.profiler's memory profile was the alternative; it reports allocator
events, not resident memory, and costs more to run on a 2-core box.

Time: median of --repeats runs after the memory run (which doubles as the warm-up), with one thread
per process (OMP) so both variants get the same share of a shared machine.

Output: a table of every run, the ratios selective / naive (goal: memory <= 0.25, time <= 1.0), and
one JSON line via bench.common.emit (appended to bench/results/logprobs.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANT_NAIVE = "naive"
VARIANT_INPLACE = "selective_inplace"  # inplace_backward=True: the gradient overwrites the logits
MODES = ("forward", "forward_backward")


def _rss_kib() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in KiB (Linux: statm pages, ru_maxrss in KiB)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    current = resident_pages * os.sysconf("SC_PAGE_SIZE") // 1024
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _variants(mode: str, chunks: list[int], default_chunk: int) -> list[tuple[str, int]]:
    """(variant, chunk) pairs measured in `mode`; the naive baseline first."""
    pairs = [(VARIANT_NAIVE, 0)] + [("selective", chunk) for chunk in chunks]
    return pairs + ([(VARIANT_INPLACE, default_chunk)] if mode == "forward_backward" else [])


def _make_run(variant: str, chunk: int, mode: str, logits, token_ids, upstream):
    """A closure running one variant once on the given inputs (logits (B, T, V), token_ids (B, T))."""
    import torch

    from engines.ppo.logprobs import selective_log_softmax

    def run() -> None:
        if variant == VARIANT_NAIVE:
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, token_ids[..., None]).squeeze(-1)
        else:
            logprobs = selective_log_softmax(
                logits, token_ids, chunk_size=chunk, inplace_backward=variant == VARIANT_INPLACE
            )
        if mode == "forward_backward":
            # autograd.grad hands back d/dlogits without accumulating it into logits.grad (which
            # would copy an in-place gradient out of the logits' storage): as in a model, where the
            # gradient only passes through lm_head's backward. It stays alive until run() returns.
            (grad_logits,) = torch.autograd.grad((logprobs * upstream).sum(), logits)
            del grad_logits

    return run


def _inputs(args: argparse.Namespace):
    import torch

    torch.manual_seed(0)
    logits = torch.randn(args.batch, args.seq, args.vocab).requires_grad_(args.mode == "forward_backward")
    return logits, torch.randint(0, args.vocab, (args.batch, args.seq)), torch.randn(args.batch, args.seq)


def _memory_worker(args: argparse.Namespace) -> dict:
    """Extra peak RSS (MiB) of one run of one variant, in this fresh process."""
    logits, token_ids, upstream = _inputs(args)
    run = _make_run(args.variant, args.chunk, args.mode, logits, token_ids, upstream)
    current_before, peak_before = _rss_kib()
    run()
    _, peak_after = _rss_kib()
    return {
        "extra_peak_mib": (peak_after - current_before) / 1024,
        "setup_slack_mib": (peak_before - current_before) / 1024,
    }  # > 0 would understate the op


def _time_worker(args: argparse.Namespace) -> dict:
    """Median seconds per variant, the variants interleaved round by round in this one process.

    Interleaving makes load from other processes on a shared machine hit every variant alike, so
    the ratios stay meaningful even when the absolute times drift. The in-place variant gets its own
    copy of the logits (restored outside the timed region), since it overwrites them.
    """
    logits, token_ids, upstream = _inputs(args)
    chunks = [int(c) for c in args.chunks.split(",")]
    runs, restores = {}, {}
    for variant, chunk in _variants(args.mode, chunks, args.default_chunk):
        own = logits.detach().clone().requires_grad_(logits.requires_grad) if variant == VARIANT_INPLACE else logits
        runs[(variant, chunk)] = _make_run(variant, chunk, args.mode, own, token_ids, upstream)
        restores[(variant, chunk)] = (lambda own=own: own.data.copy_(logits.data)) if own is not logits else None
    seconds: dict = {key: [] for key in runs}
    for round_index in range(args.repeats + 1):  # round 0 is the warm-up
        for key, run in runs.items():
            if restores[key]:
                restores[key]()
            start = time.perf_counter()
            run()
            if round_index:
                seconds[key].append(time.perf_counter() - start)
    return {f"{variant}@{chunk}": statistics.median(values) for (variant, chunk), values in seconds.items()}


def _spawn(args: argparse.Namespace, role: str, mode: str, variant: str = VARIANT_NAIVE, chunk: int = 0) -> dict:
    command = [
        sys.executable,
        "-m",
        "bench.logprobs",
        "--worker",
        role,
        "--variant",
        variant,
        "--mode",
        mode,
        "--chunk",
        str(chunk),
        "--chunks",
        args.chunks,
        "--default-chunk",
        str(args.default_chunk),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--vocab",
        str(args.vocab),
        "--repeats",
        str(args.repeats),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    if role == "memory":
        # A fixed glibc mmap threshold: blocks >= 1 MiB are mmap'd and unmapped on free. By default
        # glibc raises the threshold after the first large free and keeps later blocks in the heap,
        # so freed temporaries stay resident and the peak RSS depends on allocation history (seen:
        # 53/100/38 MiB for chunks 64/128/256 without it). Timing runs keep glibc's default, which
        # is what users get (with the fixed threshold every chunk would pay fresh page faults).
        env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench worker {role}/{mode}/{variant}/chunk={chunk} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(selective: float, naive: float) -> float:
    return round(selective / max(naive, 1e-12), 4)


def _bench_mode(args: argparse.Namespace, mode: str, chunks: list[int], figures: dict) -> None:
    """Measure every variant of one mode, print its rows and add its figures."""
    times = _spawn(args, "time", mode)
    rows = []
    for variant, chunk in _variants(mode, chunks, args.default_chunk):
        memory = _spawn(args, "memory", mode, variant, chunk)
        rows.append((variant, chunk, memory["extra_peak_mib"], times[f"{variant}@{chunk}"]))
    _, _, naive_mib, naive_s = rows[0]
    figures[f"naive_{mode}_extra_mib"] = round(naive_mib, 1)
    figures[f"naive_{mode}_ms"] = round(naive_s * 1e3, 2)
    for variant, chunk, mib, seconds in rows:
        memory_ratio, time_ratio = _ratio(mib, naive_mib), _ratio(seconds, naive_s)
        label = "naive" if variant == VARIANT_NAIVE else f"{variant}@{chunk}"
        print(f"{mode:<17} {label:<22} {mib:>10.1f} {seconds * 1e3:>10.1f} {memory_ratio:>10.3f} {time_ratio:>10.3f}")
        if variant == "selective":
            figures["by_chunk"].setdefault(str(chunk), {})[mode] = {
                "extra_mib": round(mib, 1),
                "ms": round(seconds * 1e3, 2),
                "memory_ratio": memory_ratio,
                "time_ratio": time_ratio,
            }
        suffix = "_inplace" if variant == VARIANT_INPLACE else ""
        if variant != VARIANT_NAIVE and chunk == args.default_chunk:
            figures[f"memory_ratio_{mode}{suffix}"] = memory_ratio
            figures[f"time_ratio_{mode}{suffix}"] = time_ratio


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunks", default="64,128,256,512", help="chunk sizes to try, comma-separated")
    parser.add_argument("--default-chunk", type=int, default=128, help="the chunk the headline ratios use")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds after one warm-up round")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per measuring process")
    parser.add_argument("--worker", choices=("memory", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=VARIANT_NAIVE, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="forward", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = _memory_worker(args) if args.worker == "memory" else _time_worker(args)
        print(json.dumps(result), flush=True)
        return result

    from bench.common import emit

    chunks = sorted({int(c) for c in args.chunks.split(",")} | {args.default_chunk})
    args.chunks = ",".join(str(c) for c in chunks)
    print(
        f"logits ({args.batch}, {args.seq}, {args.vocab}) fp32 = "
        f"{args.batch * args.seq * args.vocab * 4 / 2**20:.0f} MiB; {args.threads} thread(s) per process"
    )
    print(f"{'mode':<17} {'variant':<22} {'extra MiB':>10} {'median ms':>10} {'mem ratio':>10} {'time ratio':>10}")
    figures: dict = {
        "baseline": "torch.log_softmax(logits, -1).gather",
        "batch": args.batch,
        "seq": args.seq,
        "vocab": args.vocab,
        "dtype": "float32",
        "threads": args.threads,
        "repeats": args.repeats,
        "default_chunk": args.default_chunk,
        "by_chunk": {},
    }
    for mode in MODES:
        _bench_mode(args, mode, chunks, figures)
    figures["forward_goals_met"] = figures["memory_ratio_forward"] <= 0.25 and figures["time_ratio_forward"] <= 1.0
    return emit("logprobs", figures)


if __name__ == "__main__":
    main()
