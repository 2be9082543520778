"""flows/api_server.RetrySoonOnConflict: what it adds to a 503, and what Prefect's own client does with it.

The second test drives Prefect's real HTTP client (PrefectHttpxAsyncClient, the one every Prefect call goes
through) against an app that answers 503 first; the wait the client chose is read from its own debug log.
"""

import asyncio
import logging
import re

import httpx

from flows.api_server import RETRY_AFTER_S, RetrySoonOnConflict


def _app_answering(statuses: list[int], headers: list[tuple[bytes, bytes]] = ()):
    """An ASGI app that answers the i-th request with statuses[i] (the last one after that)."""
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["type"])
        if scope["type"] != "http":
            return
        status = statuses[min(len(calls) - 1, len(statuses) - 1)]
        await send({"type": "http.response.start", "status": status, "headers": list(headers)})
        await send({"type": "http.response.body", "body": b"{}"})

    app.calls = calls
    return app


def _responses(app, scope_type="http"):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    asyncio.run(RetrySoonOnConflict(app)({"type": scope_type}, receive, send))
    return sent


def test_a_503_gets_the_short_retry_after_and_nothing_else_changes():
    start = _responses(_app_answering([503]))[0]
    assert (b"retry-after", RETRY_AFTER_S.encode()) in start["headers"]

    ok = _responses(_app_answering([200], headers=[(b"x-a", b"1")]))[0]
    assert ok["headers"] == [(b"x-a", b"1")]

    own = _responses(_app_answering([503], headers=[(b"Retry-After", b"7")]))[0]
    assert own["headers"] == [(b"Retry-After", b"7")]  # a server's own Retry-After is kept

    app = _app_answering([200])
    assert _responses(app, scope_type="lifespan") == [] and app.calls == ["lifespan"]


def _waits_chosen_by_prefect_client(app) -> tuple[int, list[float]]:
    """GET / through Prefect's HTTP client; (final status, the waits in s its retry loop logged)."""
    from prefect.client.base import PrefectHttpxAsyncClient

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("prefect.client")
    handler, level = Keep(level=logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:

        async def get():
            async with PrefectHttpxAsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
                return (await c.get("/")).status_code

        status = asyncio.run(get())
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    waits = [float(m) for r in records for m in re.findall(r"Another attempt will be made in ([0-9.]+)s", r)]
    return status, waits


def test_prefect_client_retries_after_50_ms_instead_of_2_s():
    from prefect.settings import PREFECT_CLIENT_RETRY_JITTER_FACTOR

    jitter = PREFECT_CLIENT_RETRY_JITTER_FACTOR.value()
    app = _app_answering([503, 503, 200])
    status, waits = _waits_chosen_by_prefect_client(RetrySoonOnConflict(app))
    assert status == 200 and app.calls.count("http") == 3
    assert len(waits) == 2
    assert all(float(RETRY_AFTER_S) <= w <= float(RETRY_AFTER_S) * (1 + jitter) + 1e-9 for w in waits)

    # the before: the same 503 without the header costs the client's exponential back-off, 2**1 s +- jitter
    status, waits = _waits_chosen_by_prefect_client(_app_answering([503, 200]))
    assert status == 200 and len(waits) == 1 and waits[0] >= 2 * (1 - jitter) - 1e-9
