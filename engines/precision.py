"""Whether bfloat16 autocast pays on this machine: the check behind preflight's refusal of
`model.autocast_dtype=bfloat16` on a CPU without bfloat16 matmul kernels.

`torch.autocast("cpu", dtype=torch.bfloat16)` gives the same results on every CPU, but it is fast only where
torch has bfloat16 GEMM kernels for the CPU: oneDNN's, which ATen picks when
`torch.ops.mkldnn._is_mkldnn_bf16_supported()` (x86 with AVX-512, natively with AVX512-BF16 or AMX; Arm
with BF16). Elsewhere ATen falls back to a scalar loop. On an AMD EPYC with AVX2 and no AVX-512 a 128^3
bfloat16 matmul ran ~20x slower than float32 (one thread; the gap grows with the size: 0.3 against ~140
GFLOP/s on a 135M model's shapes), and one GRPO update of SmolLM2-135M took 10.5 min under bfloat16
autocast against 38 s in float32. GPUs have bfloat16 tensor cores: nothing is checked there.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import torch

# The timed matmul of `bf16_matmul_slowdown`: 128^3 costs ~1.4 ms in bfloat16 where it is emulated, 0.07 in
# float32; the best of 5 each keeps the ratio steady on a machine shared with other work.
_PROBE_SIZE = 128
_PROBE_REPEATS = 5


class CpuBf16(NamedTuple):
    """What torch knows about this CPU and bfloat16 matmuls."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", "SVE256", "DEFAULT", ...
    kernels: bool  # torch has bfloat16 matmul kernels for it (oneDNN's); False = a slow scalar fallback


def cpu_bf16() -> CpuBf16:
    """This CPU's capability and whether torch runs bfloat16 matmuls on it with real kernels (no timing)."""
    kernels = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return CpuBf16(torch.backends.cpu.get_cpu_capability(), kernels)


def bf16_matmul_slowdown(size: int = _PROBE_SIZE, repeats: int = _PROBE_REPEATS) -> float:
    """Seconds of a size x size x size bfloat16 matmul over the same in float32 on this CPU (> 1: bfloat16
    is slower). One thread, best of `repeats` each, so a machine shared with other work still gives a steady
    figure; the caller's thread count is restored. A few ms where bfloat16 is emulated."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            a @ b  # first call: allocation and dispatch, not the kernel
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - start)
            seconds[dtype] = best
    finally:
        torch.set_num_threads(threads)
    return seconds[torch.bfloat16] / max(seconds[torch.float32], 1e-9)


def cpu_autocast_problem(autocast_dtype: Optional[str]) -> Optional[str]:
    """The refusal of `model.autocast_dtype=bfloat16` when the models would run on a CPU without bfloat16
    matmul kernels (the message names the capability, the measured slowdown and the fix), else None: no
    autocast, a GPU, or a CPU that has the kernels. Times one small matmul only when refusing."""
    if autocast_dtype != "bfloat16" or torch.cuda.is_available():
        return None
    cpu = cpu_bf16()
    if cpu.kernels:
        return None
    ratio = bf16_matmul_slowdown()
    return (
        f"model.autocast_dtype=bfloat16 on a CPU without bfloat16 matmul kernels (torch reports {cpu.capability}; "
        f"they need AVX-512, AVX512-BF16 or AMX): a {_PROBE_SIZE}^3 bfloat16 matmul ran {ratio:.0f}x slower than "
        f"float32 here just now, and a whole update runs ~16x slower (10.5 min against 38 s for a 135M model); "
        f"run in float32 with --set model.autocast_dtype=null"
    )
