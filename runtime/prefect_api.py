"""Is the Prefect API that PREFECT_API_URL names there? Asked once, before a command does any work.

Without the check, a PREFECT_API_URL pointing at a server that is not running (a closed port, a stopped
`prefect server start`) surfaced as `ConnectError: [Errno 111] Connection refused` from deep inside
Prefect, naming neither the setting nor what to do. `check_prefect_api` asks the API's /health once
(Prefect's own client, so its TLS and auth settings apply) and raises ConfigError naming PREFECT_API_URL,
its value, where it was set, and the ways out: start that server, point the setting at one that runs, or
unset it so that Prefect starts a temporary local server for the command (the default, nothing to run).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Optional
from urllib.parse import urlsplit

from ppoflow.config import ConfigError


def _where_set() -> tuple[str, str]:
    """(where PREFECT_API_URL was set, the command that unsets it there)."""
    if os.environ.get("PREFECT_API_URL"):
        return "in the environment", "unset PREFECT_API_URL"
    from prefect.context import get_settings_context

    profile = get_settings_context().profile.name
    return f"in Prefect profile {profile!r}", "prefect config unset PREFECT_API_URL"


def prefect_api_problem() -> Optional[str]:
    """Why the Prefect API named by PREFECT_API_URL cannot be used (see the module docstring), or None when it
    answers or none is set (a temporary local server is then started for the command)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        return None
    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is None:
        return None
    where, unset = _where_set()
    parts = urlsplit(url)
    start = f"ppoflow prefect-server --host {parts.hostname} --port {parts.port or 4200}"
    return (
        f"PREFECT_API_URL={url} (set {where}) does not answer: {type(error).__name__}: {error}\n"
        f"Start the Prefect server it names (`{start}`), point PREFECT_API_URL at one that runs, or unset it "
        f"(`{unset}`) to run on a temporary local Prefect server that the command starts and stops itself."
    )


def check_prefect_api() -> None:
    """Raise ConfigError when PREFECT_API_URL names a Prefect API that does not answer; see the module docstring."""
    if problem := prefect_api_problem():
        raise ConfigError(problem)


@contextlib.contextmanager
def temporary_server_starting() -> Iterator[None]:
    """Within the block, Prefect's temporary server starts in a thread, as Prefect's client would start it (its
    SubprocessASGIServer, which every later client finds running); leaving the block waits until it answers and
    raises its start error, if any. Without a server to start (PREFECT_API_URL set, or ephemeral mode off): nothing.

    Why: of the start (~9 s on the 2-core machine: the server process imports Prefect's server, migrates its
    database, starts its services) this process only waits for /health, so a caller overlaps it with work of its
    own (flows/run.py builds the rollout engine). Nothing in the block may use the Prefect API: Prefect marks the
    server running before it answers."""
    from prefect.settings import PREFECT_SERVER_ALLOW_EPHEMERAL_MODE, get_current_settings

    if get_current_settings().api.url or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    errors: list[BaseException] = []

    def start() -> None:
        try:
            SubprocessASGIServer().start()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(e)

    thread = threading.Thread(target=start, daemon=True, name="ppoflow-prefect-server-start")
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if errors:
        raise errors[0]
