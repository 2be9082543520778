"""The process around a vLLM engine: where its IPC sockets go, which CPUs it computes on, how its logs are filtered,
how its children end.

vLLM runs its engine core (and workers) in spawned processes that read their settings from the environment,
so what is set here must be set before the first `LLM` is built. A value the user set always wins.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import os
import shutil
import tempfile

log = logging.getLogger("ppoflow.rollout")

_PRIVATE_FOLDER: list[str] = []


def private_folder() -> str:
    """A temp folder of this process's own (IPC sockets, the logging config), removed at exit."""
    if not _PRIVATE_FOLDER:
        folder = tempfile.mkdtemp(prefix="ppoflow-vllm-ipc-")
        atexit.register(shutil.rmtree, folder, True)
        _PRIVATE_FOLDER.append(folder)
    return _PRIVATE_FOLDER[0]


def private_ipc_dir() -> None:
    """Point vLLM's ZeroMQ IPC sockets at a folder of this process's own, removed at exit.

    vLLM names a socket file `<VLLM_RPC_BASE_PATH>/<uuid4>` (default: the system temp folder) for each
    engine and never unlinks it, so every engine start left files in /tmp for good. A value the user set
    is kept. Set before the first `LLM` is built: the spawned engine-core process inherits it.
    """
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return
    os.environ["VLLM_RPC_BASE_PATH"] = private_folder()


CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def bind_all_cpus() -> None:
    """Bind vLLM's CPU engine core to every CPU this process may run on (VLLM_CPU_OMP_THREADS_BIND = "0,1,...").

    vLLM 0.32's default ("auto") binds the engine core's OpenMP threads to the machine's cores minus one, which
    it reserves for the calling process's scheduler loop. On the 2-core machine that left the engine one thread
    (its log: "core ids=[0]") while ppoflow's process mostly waits for it: the recipe's rollout on SmolLM2 (16
    prompts x 4 samples x 16 tokens) took 11.8-12.6 s on one core, 6.1-7.5 s on both. An explicit list reserves
    nothing. Set before the first `LLM` is built (the engine core reads it when it starts); a value the user set
    (a list, "auto", "nobind") is kept. Not called on a GPU, where vLLM binds nothing.
    """
    if CPU_BIND in os.environ or not hasattr(os, "sched_getaffinity"):
        return
    os.environ[CPU_BIND] = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


class RotaryReloadWarningFilter(logging.Filter):
    """Drops exactly vLLM's "RotaryEmbedding: Failed to load weights", which every weight reload logs.

    Why it is harmless (vLLM 0.32, model_executor/model_loader/reload/layerwise.py): the in-place reload
    counts every parameter AND buffer of a layer as loadable (`get_layer_size`). RotaryEmbedding holds
    only `cos_sin_cache`, a non-persistent buffer computed from the rope settings of config.json, never
    stored in a checkpoint, so no checkpoint tensor ever reaches it: `load_numel` stays 0 while
    `load_numel_total` > 0, and `finalize_layerwise_processing` logs the warning and puts the layer's
    start-up tensors back (`_place_kernel_tensors`), i.e. the cos/sin cache computed for this very
    architecture (`load_weights` refuses a checkpoint whose config.json differs). Nothing is lost:
    tests/integration/test_vllm_rollout.py::test_logprobs_match_transformers_recompute reloads the weights
    and then matches a transformers forward to 2e-5 nats, which a wrong rotary cache (positions) would not.
    The message is vLLM's accounting, not a failed load; other layers' "Failed to load weights" still show.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def install_vllm_log_filter(folder: str) -> None:
    """Make vLLM's processes (this one and the spawned engine core and workers) use vLLM's default logging
    config plus RotaryReloadWarningFilter, through VLLM_LOGGING_CONFIG_PATH (read when the engine's config
    is built and handed to its children). A logging config the user set (or VLLM_CONFIGURE_LOGGING=0) wins.
    """
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["filters"] = {"ppoflow_rotary_reload": {"()": f"{__name__}.RotaryReloadWarningFilter"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["ppoflow_rotary_reload"]
    path = os.path.join(folder, "vllm-logging.json")
    with open(path, "w") as f:
        json.dump(config, f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path


def child_processes():
    """This process's vLLM children (engine core, workers), as psutil processes."""
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]


def reap(processes, timeout_s: float = 15.0) -> None:
    """Wait for the engine's processes (reaping zombies); kill whatever is still alive after `timeout_s`."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for proc in alive:
        log.warning("vllm: killing engine process %d that did not exit", proc.pid)
        proc.kill()
    psutil.wait_procs(alive, timeout=5)
