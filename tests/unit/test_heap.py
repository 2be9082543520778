"""engines/trainer/heap.py: after retain_freed_memory, memory a process frees stays mapped for its next use.

Each case runs in a fresh interpreter (mallopt changes a process for good). What is measured is the kernel's
account, not the module's: the process's resident set (/proc/self/statm) after freeing 256 blocks of 1 MiB that it
wrote, and the minor page faults (getrusage) of writing the same amount again. With glibc's defaults the freed
memory goes back to the kernel (1 MiB blocks start above the 128 KiB mmap threshold) and every page of the second
pass faults; with the heap kept, the second pass reuses the pages.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

SCRIPT = """
import ctypes, json, os, resource, sys
retain = sys.argv[1] == "retain"
if retain:
    from engines.trainer.heap import retain_freed_memory
    took = retain_freed_memory()
else:
    took = None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
MiB, page = 2**20, os.sysconf("SC_PAGE_SIZE")

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page

def write_blocks():
    blocks = [libc.malloc(MiB) for _ in range(256)]
    for b in blocks:
        ctypes.memset(b, 1, MiB)
    return blocks

blocks = write_blocks()
full = rss()
for b in reversed(blocks):
    libc.free(b)
after_free = rss()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = write_blocks()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"took": took, "released_mib": (full - after_free) / MiB, "refault_pages": faults}))
"""


def _run(mode: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_default_heap_gives_freed_memory_back_and_faults_it_in_again():
    default = _run("default")
    assert default["released_mib"] > 200  # of the 256 MiB written and freed
    assert default["refault_pages"] > 200 * 2**20 // 4096  # ~one fault per 4 KiB page written again


def test_a_retained_heap_keeps_freed_memory_and_reuses_it_without_faults():
    kept = _run("retain")
    assert kept["took"] is True  # glibc accepted the three settings
    assert kept["released_mib"] < 16
    assert kept["refault_pages"] < 1000  # 65,536 pages written again; a few interpreter pages may still fault
