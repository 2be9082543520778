"""`ppoflow prefect-server`: Prefect's own server (API, services, SQLite by default), with one change in how it
answers a lock conflict.

Why: on SQLite, Prefect's server runs each request in a DEFERRED transaction. A request that reads and then
writes (creating a task run reads the flow run's labels first, then inserts) fails at once with
SQLITE_BUSY when another connection committed in between: busy_timeout does not apply to a stale
snapshot. The server answers 503 with no Retry-After, and Prefect's client then waits 2**1 = 2 s before the
retry (prefect/client/base.py). With warm stage workers and pipelined iterations several processes write
at once, and measured on the 2-core machine with `ppoflow worker` and max_staleness 1, 9 to 15 task-run
submissions of 8 iterations met that conflict: up to 2 s each on the trainer's path. The retry itself
succeeds; only the wait is wrong.

What this changes: a 503 leaving the server gets `Retry-After: 0.05` when it has none, so the client
(which honours the header, adding up to its jitter factor) retries after ~50-70 ms. Nothing else differs
from `prefect server start`: the same app (`prefect.server.api.server.create_app`), the same settings
(PREFECT_HOME, PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_SERVER_*), services in the same process.
On PostgreSQL the conflict does not arise (row locks) and the change is idle. A 503 the server sends for
another reason gets the same short wait; the client still gives up after PREFECT_CLIENT_MAX_RETRIES.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

RETRY_AFTER_S = "0.05"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class RetrySoonOnConflict:
    """ASGI middleware: adds `Retry-After: RETRY_AFTER_S` to every HTTP 503 response that has no Retry-After.
    Other responses, websockets and lifespan events pass through untouched."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_retry_after(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    headers.append((b"retry-after", RETRY_AFTER_S.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)


def serve_prefect_api(host: str, port: int, log_level: str = "info") -> None:
    """Run Prefect's server app (API and services) on host:port until interrupted. Blocks."""
    import uvicorn
    from prefect.server.api.server import create_app

    uvicorn.run(RetrySoonOnConflict(create_app(final=True)), host=host, port=port, log_level=log_level)
