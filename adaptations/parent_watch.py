"""A child process that ends when the process that started it is gone, however that one died.

Used by Prefect's temporary server (adaptations/prefect_server.py) and vLLM's engine core
(adaptations/vllm_client_watch.py): both are stopped by their parent's atexit hook or its request, which a
SIGKILL (the OOM killer, kill -9) never sends. Not prctl(PR_SET_PDEATHSIG): it fires when the *thread* that
started the child exits, and the child may be started from a worker thread that ends long before the process
(Prefect's events worker starts the server; the early engine build runs beside a starting server).
"""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_POLL_S = 0.5
SHUTDOWN_GRACE_S = 10.0


def watch_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Stop this process once `parent_pid` is no longer its parent (a dead parent's children are handed to init or
    a subreaper): SIGTERM to itself, so its own shutdown runs, then, SHUTDOWN_GRACE_S later, os._exit if that did
    not end it. Returns the watching (daemon) thread."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(SHUTDOWN_GRACE_S)
        os._exit(1)

    thread = threading.Thread(target=watch, name="ppoflow-parent-watch", daemon=True)
    thread.start()
    return thread
