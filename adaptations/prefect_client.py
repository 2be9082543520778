"""One TLS context per process for Prefect's API clients.

Prefect 3.7 builds a new `PrefectClient` / `SyncPrefectClient` for most API calls made outside a client context:
every `.delay()` (Task.create_run), every wait on a task worker's future, every read of a persisted result (the
server's default storage block), and in a task worker every task run it executes. Each client builds its own
`ssl.create_default_context(cafile=certifi.where())`, and loading that CA bundle costs ~20 ms of CPU with
OpenSSL 3, whether or not the API URL is https. Measured with py-spy on bench.async's driver (warm workers,
k = 1): 41% of the driver's CPU after start-up went there. Prefect has an open pull request to let clients share
a context (PrefectHQ/prefect#19106); until one is released, `share_tls_context` makes the two constructors in
`prefect.client.orchestration` get one context per (purpose, cafile, capath, cadata) for the process.

Sharing is what TLS contexts are for: an SSLContext holds settings and trust roots, not connection state, and
CPython's is safe to use from several threads. The context Prefect builds for PREFECT_API_TLS_INSECURE_SKIP_VERIFY
(no CA file; Prefect turns verification off on it) has its own cache entry, so a verifying client never gets it.
A CA file whose content changes while the process runs is not read again (a new PREFECT_API_SSL_CERT_FILE path
is). With a Prefect whose client module no longer looks this way, nothing is changed.
"""

from __future__ import annotations

import ssl
import threading
from typing import Any

from adaptations.stand_in import install_stand_in


class _SharedDefaultContexts:
    """Stands in for the `ssl` module inside prefect.client.orchestration: `create_default_context` returns one
    context per argument set; every other attribute is the real module's."""

    def __init__(self) -> None:
        self._contexts: dict[tuple, ssl.SSLContext] = {}
        self._lock = threading.Lock()

    def create_default_context(
        self, purpose: Any = ssl.Purpose.SERVER_AUTH, *, cafile=None, capath=None, cadata=None
    ) -> ssl.SSLContext:
        key = (purpose, cafile, capath, cadata)
        with self._lock:
            if key not in self._contexts:
                self._contexts[key] = ssl.create_default_context(purpose, cafile=cafile, capath=capath, cadata=cadata)
            return self._contexts[key]

    def __getattr__(self, name: str) -> Any:
        return getattr(ssl, name)


def share_tls_context() -> bool:
    """Install the shared contexts in Prefect's client module (idempotent); False when its layout is not the
    expected one (then Prefect is left as it is).

    Works around: Prefect 3.7.7 builds an SSLContext per client (module docstring; PrefectHQ/prefect#19106 would
    let clients share one). Installed by adaptations.install_process_adaptations; still needed while
    tests/unit/test_adaptations_prefect_client.py finds two unpatched clients with two contexts."""
    from prefect.client import orchestration

    return install_stand_in(orchestration, "ssl", ssl, _SharedDefaultContexts)
