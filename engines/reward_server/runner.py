"""Run the reward server: `serve()` for the CLI (blocks), `serve_in_thread()` for tests and benchmarks.

Loopback (127.0.0.1) is the default host: a reward server hands out scores that steer training, and a
bearer token is the only guard, so exposing it on other interfaces must be a deliberate choice.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from fastapi import FastAPI

from engines.reward_server.app import build_app
from engines.rewards.base import RewardSource

log = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(source: RewardSource, host: str = "127.0.0.1", port: int = 8000, token: str = "", **limits) -> None:
    """Serve `source` with uvicorn until interrupted; `limits`: ServerLimits' fields (engines/reward_server/app.py).
    Raises ValueError for an empty token or a bad limit."""
    import uvicorn

    app = build_app(source, token, **limits)
    if not _is_loopback(host):
        log.warning(
            "reward server listening on %s, not loopback: anyone who can reach it and holds the token can score", host
        )
    log.info(
        "reward server for %r (identity %s) on http://%s:%d", source.name, getattr(source, "identity", "?"), host, port
    )
    uvicorn.run(app, host=host, port=port, log_level="info")


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run `app` with uvicorn in a daemon thread on a free port of `host`; yields its base URL.

    The socket is bound here (port 0) and handed to uvicorn, so there is no window in which another
    process can take the port. The server is stopped and the thread joined on exit.
    Raises RuntimeError when the server does not start within start_timeout_s.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"reward-server-{port}")
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"reward server on {host}:{port} did not start within {start_timeout_s} s")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=start_timeout_s)
        sock.close()
