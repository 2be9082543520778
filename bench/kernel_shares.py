"""Where an update's device time goes: one profiled update, its kernels sorted into matmul, attention and the rest.

    shares = profile_shares(lambda: trainer.update(batch), device="cuda")
    shares["matmul_share"], shares["top"]

GPU: torch.profiler's CUDA kernel events, each kernel's own device time, classified by name: cuBLAS /
CUTLASS GEMMs (`gemm`, `cutlass`, `nvjet`, `xmma`, `wgmma`, `sm90_`) are matmuls; flash / memory-efficient
attention kernels (`flash`, `fmha`, `attention`) are attention; everything else (element-wise, reductions,
copies, the optimizer's fused kernels) is "other". CPU: the same over aten operators' own CPU time
(`aten::mm`, `addmm`, `bmm`, `linear` ... are matmuls; `scaled_dot_product` is attention), so the code
path runs in CI where there is no GPU.

The classifier is by name only: a kernel named like none of the patterns counts as "other", so the matmul
share is a lower bound when a new GEMM library names its kernels otherwise (the `top` list shows the names).
"""

from __future__ import annotations

import re
import time
from typing import Callable

_MATMUL = re.compile(r"gemm|cutlass|nvjet|xmma|wgmma|sm90_|cublas|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|scaled_dot_product", re.I)


def kernel_class(name: str) -> str:
    """ "matmul", "attention" or "other" for a CUDA kernel's or an aten operator's name."""
    if _ATTENTION.search(name):
        return "attention"
    if _MATMUL.search(name):
        return "matmul"
    return "other"


def shares_of(times: dict[str, float], top: int = 12) -> dict:
    """{kernel name: seconds} -> matmul/attention/other shares of the total, the total, and the `top` names.

    Raises ValueError when there is no time at all (a profile that caught nothing)."""
    total = sum(times.values())
    if total <= 0:
        raise ValueError("the profile holds no kernel time: nothing ran on the profiled device")
    by_class = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, seconds in times.items():
        by_class[kernel_class(name)] += seconds
    ranked = sorted(times.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {
        "profiled_s": round(total, 6),
        **{f"{cls}_share": round(seconds / total, 4) for cls, seconds in by_class.items()},
        "top": [{"name": name[:120], "s": round(s, 6), "class": kernel_class(name)} for name, s in ranked],
    }


def profile_shares(run: Callable[[], object], device: str, top: int = 12) -> dict:
    """Run `run()` once under torch.profiler and return `shares_of` its kernels' (GPU) or operators' (CPU)
    own time. The GPU is synchronised before the profile closes, so every kernel of the call is counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - began
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if device == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            seconds = event.self_device_time_total / 1e6
        else:
            if not event.key.startswith("aten::"):
                continue
            seconds = event.self_cpu_time_total / 1e6
        if seconds > 0:
            times[event.key] = times.get(event.key, 0.0) + seconds
    shares = shares_of(times, top)
    # Kernel time over the call's wall time: below 1 where the device waited for the host (launches, syncs).
    shares["busy_share"] = round(shares["profiled_s"] / wall, 4)
    shares["wall_s"] = round(wall, 6)
    return shares
