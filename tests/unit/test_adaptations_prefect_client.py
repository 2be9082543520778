"""Prefect's API clients share one TLS context per process once adaptations/prefect_client.py is installed."""

from __future__ import annotations

import ssl

import certifi
import pytest


@pytest.fixture
def api_url(monkeypatch):
    # Building a client opens no connection; the URL only has to be set (no ephemeral server is started).
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        yield


def _context_of(client) -> ssl.SSLContext:
    return client._client._transport._pool._ssl_context  # httpx 0.28 / httpcore 1.0: the pool's context


def test_clients_share_one_verifying_context(api_url):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_SSL_CERT_FILE

    from adaptations.prefect_client import share_tls_context

    share_tls_context()

    sync_a, sync_b, async_a = get_client(sync_client=True), get_client(sync_client=True), get_client()
    shared = _context_of(sync_a)
    assert _context_of(sync_b) is shared and _context_of(async_a) is shared
    # It still verifies: certificates required, host names checked, the roots Prefect names loaded.
    assert shared.verify_mode == ssl.CERT_REQUIRED and shared.check_hostname
    fresh = ssl.create_default_context(cafile=PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
    assert shared.cert_store_stats() == fresh.cert_store_stats()


def test_the_insecure_context_is_not_the_verifying_one(api_url):
    from prefect.client import orchestration
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_TLS_INSECURE_SKIP_VERIFY, temporary_settings

    from adaptations.prefect_client import share_tls_context

    assert share_tls_context() and share_tls_context()  # idempotent
    verifying = _context_of(get_client(sync_client=True))
    with temporary_settings(updates={PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
        insecure = _context_of(get_client(sync_client=True))
    assert insecure is not verifying and insecure.verify_mode == ssl.CERT_NONE
    assert verifying.verify_mode == ssl.CERT_REQUIRED  # Prefect's edits of the insecure one did not reach it
    assert orchestration.ssl.SSLContext is ssl.SSLContext  # every other attribute is the real module's


def test_a_client_module_of_another_shape_is_left_alone(monkeypatch):
    from prefect.client import orchestration

    from adaptations import prefect_client

    monkeypatch.setattr(orchestration, "ssl", object())  # a Prefect whose client module no longer uses `ssl` so
    assert prefect_client.share_tls_context() is False


_UNADAPTED = """
import json, ssl, sys
import runtime.workers, tasks  # ppoflow's packages: importing them must adapt nothing
from prefect.client import orchestration
from prefect.client.orchestration import get_client

def context_of(client):
    return client._client._transport._pool._ssl_context

a, b = get_client(sync_client=True), get_client(sync_client=True)
print(json.dumps({"untouched": orchestration.ssl is ssl, "shared": context_of(a) is context_of(b)}))
"""


def test_upstream_still_builds_a_context_per_client_and_importing_ppoflow_changes_nothing(tmp_path):
    """Fails once Prefect shares a context itself (PrefectHQ/prefect#19106): then remove share_tls_context."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_HOME": str(tmp_path / "home")}
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _UNADAPTED], env=env, cwd=repo, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"untouched": True, "shared": False}
