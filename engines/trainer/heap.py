"""Keep the memory an update frees for the next update: glibc's malloc tuned once per training process.

Why: an update allocates and frees gigabytes of activations and gradients' temporaries. With glibc's defaults the
freed top of the heap, and the heaps of the threads' arenas, are handed back to the kernel, and the next update takes
them again page by page, each 4 KiB page a minor fault that the kernel zeroes. On the README recipe (SmolLM2-135M,
2 cores) a steady update of `ppoflow train` took 0.35-0.82 M minor faults and 2.1-3.9 s of system time; with these
settings, 0.11-0.16 M and 0.7-0.9 s (CHANGELOG). The stages in between (rollout, score) allocate less than an update
and reuse the kept memory instead of faulting in their own, so the process's peak is still the update's.

    retain_freed_memory()   M_TRIM_THRESHOLD 2 GiB (the largest mallopt takes), M_TOP_PAD 64 MiB (an arena heap's
                            size), M_MMAP_THRESHOLD 32 MiB (glibc's largest on 64-bit)

Setting either threshold turns glibc's dynamic mmap threshold off, so both are set: with trimming off alone the
threshold would stay where the process left it (128 KiB at start), and every tensor above it would be mapped and
unmapped, faulting on each use. Blocks above 32 MiB (a micro-batch's logits, 16 x 16 x 49,152 float32) are mapped
whatever the setting; glibc refuses a larger threshold.

Only glibc on Linux: elsewhere (macOS, musl) nothing is changed. Failure modes: none raised; a libc without mallopt
is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

# mallopt parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# The largest M_MMAP_THRESHOLD glibc takes on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX: 4 x 1 MiB x sizeof(long)).
MMAP_THRESHOLD_MAX = 32 * 2**20
# mallopt takes an int: trim only when 2 GiB lie free at the heap top (no update of the recipe frees that much)
TRIM_THRESHOLD = 2**31 - 1
# The heaps of glibc's per-thread arenas (the OpenMP workers' allocations) are 64 MiB each; one that becomes wholly
# free is unmapped, and one with free space at its top shrunk, unless the top pad says to keep that much.
TOP_PAD = 64 * 2**20

_lock = threading.Lock()
_done = False


def retain_freed_memory() -> bool:
    """Tune this process's glibc malloc as the module docstring says; once per process (later calls do nothing).
    True when glibc took all three settings (now or on an earlier call), False where there is no glibc."""
    global _done
    with _lock:
        if _done:
            return True
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return False
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is None:
            return False
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
        ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
        ok = mallopt(_M_TOP_PAD, TOP_PAD) == 1 and ok
        _done = ok
        return ok
