"""runtime/prefect_api.py: a PREFECT_API_URL that does not answer is one message naming the setting, its value and
the ways out, asked of the API before any work (before: `ConnectError: [Errno 111] Connection refused`)."""

import socket

import pytest

from ppoflow.config import ConfigError
from runtime.prefect_api import check_prefect_api, prefect_api_problem


def _closed_port() -> int:
    """A loopback port nothing listens on: bound, then closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_closed_port_is_named_with_the_setting_and_what_to_do(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    port = _closed_port()
    url = f"http://127.0.0.1:{port}/api"
    monkeypatch.setenv("PREFECT_API_URL", url)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        problem = prefect_api_problem()
        with pytest.raises(ConfigError) as err:
            check_prefect_api()
    first, second = problem.splitlines()
    assert first.startswith(f"PREFECT_API_URL={url} (set in the environment) does not answer: ConnectError:")
    assert f"`ppoflow prefect-server --host 127.0.0.1 --port {port}`" in second
    assert "unset it (`unset PREFECT_API_URL`) to run on a temporary local Prefect server" in second
    assert str(err.value) == problem


def test_no_setting_is_no_problem(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert prefect_api_problem() is None  # the command starts its own temporary server
