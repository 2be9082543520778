"""Prefect's server, adapted (written against Prefect 3.7.7).

`ppoflow prefect-server`: Prefect's own server (API, services, SQLite by default), with one change in how it
handles a lock conflict.

Why: on SQLite, Prefect's server runs each request in a DEFERRED transaction. A request that reads and then
writes (creating a task run reads the flow run's labels first, then inserts) fails at once with
SQLITE_BUSY when another connection committed in between: busy_timeout does not apply to a stale
snapshot. The transaction rolls back, the server answers 503 with no Retry-After, and Prefect's client waits
2**1 = 2 s before sending the request again (prefect/client/base.py). With warm stage workers and pipelined
iterations several processes write at once: measured on the 2-core machine with three `ppoflow worker`s and
max_staleness 1, 9 to 15 task-run submissions of 8 iterations met the conflict, each 2 s on the trainer's
path. The retry itself succeeds; only the wait is wrong.

What this changes: the server replays such a request itself, at once, before the client sees anything: a
request whose answer is 503 is run again (same method, path, headers and body) after 10, 20, 40, 80 and
160 ms. That is what the client's own retry would send, and safe for the same reason: a 503 here means the
request's transaction rolled back (prefect/server/api/server.py sends 503 only for errors it calls
retryable). If the conflict outlasts those ~0.3 s, the client gets the 503 as before and backs off as before
(2, 4, 8 s ...), so heavy contention is handled by Prefect's own back-off.

A fixed short Retry-After header instead would not do: the client gives up after PREFECT_CLIENT_MAX_RETRIES
(5) attempts, and 5 x 50 ms did not outlast the conflicts of max_staleness 2 (a run failed with the 503).

Nothing else differs from `prefect server start`: the same app (`prefect.server.api.server.create_app`), the
same settings (PREFECT_HOME, PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_SERVER_*), services in the same
process. On PostgreSQL the conflict does not arise (row locks) and the change is idle.

Prefect's temporary server (the embedded default: no PREFECT_API_URL, Prefect starts a server process of its
own for the run) meets the same conflict with one flow writing: its services (the task-run recorder, the event
persister) write beside the flow's requests. Measured on the 2-core machine with the demo's workload (0.7 s
iterations) on a PREFECT_HOME that kept earlier runs: five runs of 20 to 30 iterations met 0, 2, 3, 5 and 10 such
2 s waits before a subflow run started (none in a fresh database's first 30 iterations), four runs with the
replaying app none.
`replay_on_temporary_server` makes that server the same app behind the same middleware, and starts it at the
lowest CPU priority (nice 19, `yield_to_compute`).

Why the lower priority: the temporary server serves this one process. Its answers are awaited by a thread that
blocks meanwhile, so a core is free for it then; its other work (the task-run recorder and the event persister
taking the events the run sends in the background, the logs, its loop services: ~0.27 CPU-s per iteration of
bench.overhead's batch workload) otherwise lands on a core the run's compute is using. Torch's OpenMP team
spins at its barriers, so a core taken from one of its threads stalls them all for as long. At nice 19 that
work waits for a core the compute leaves idle (between ops, the Python-only parts of a stage, every request).
Measured on the 2-core machine in turns against the bare loop (bench.overhead, batch workload): ratio 1.11 and
1.13 at nice 0 (0.62-0.68 s per iteration over the bare loop); at nice 19, three runs of 16 iterations x 2
rounds: 0.992, 1.074 and 1.037 (all 90 pairs pooled: 1.002; ratio of totals 1.029); tiny workload: 0.29 s per
iteration over the bare loop against 0.36. Pipelined (max_staleness 1) tiny runs, outside the bench: 0.76 and
0.72 s per iteration at 19 against 0.73 and 0.70 at 0, noise-level. Only the temporary server is lowered: a
server other processes share (`ppoflow prefect-server`, `prefect server start`) is left as it is.

The temporary server also dies with the process that started it, however that process dies. Prefect stops it
from an atexit hook, which SIGKILL (the OOM killer) never runs: the server went on running, holding its port
and the database, with nobody to stop it. So the command that starts it passes its own pid
(PARENT_PID_VARIABLE), and `create_replaying_app` starts a daemon thread that checks every
PARENT_POLL_S whether the server's parent is still that pid (a dead parent's children are handed to init or a
subreaper). When it is not, the server stops itself as on SIGTERM (uvicorn's shutdown, Prefect's lifespan),
and exits at once if that has not ended it within SHUTDOWN_GRACE_S. Not prctl(PR_SET_PDEATHSIG): it fires
when the *thread* that started the child exits, and Prefect may start the server from a worker thread (its
events worker does) that ends long before the process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any, Awaitable, Callable, Optional

from adaptations.parent_watch import watch_parent
from adaptations.stand_in import install_stand_in

REPLAY_DELAYS_S = (0.01, 0.02, 0.04, 0.08, 0.16)
TEMPORARY_SERVER_NICENESS = 19  # the lowest priority: the server runs when the run's compute leaves a core idle
PARENT_PID_VARIABLE = "PPOFLOW_SERVER_PARENT_PID"  # set for the temporary server only: the pid it dies with

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class ReplayOnConflict:
    """ASGI middleware: an HTTP request answered 503 is run again after each of `delays` seconds; the first
    answer that is not 503 (or the last 503) goes to the client. Websockets and lifespan pass through.

    The request body is read once and handed to every attempt. An answer is held back only until its status
    is known (http.response.start); any other answer streams through as it is produced. An exception the app
    raises after sending its 503 (Starlette's error middleware re-raises) is dropped on an attempt that is
    replayed and re-raised on the last one, as it would have been without this middleware."""

    def __init__(self, app: App, delays: tuple[float, ...] = REPLAY_DELAYS_S):
        self.app = app
        self.delays = delays

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        for delay in (*self.delays, None):
            replay_receive = _replaying(body, receive)
            if delay is None:  # the last attempt: whatever it answers goes to the client
                await self.app(dict(scope), replay_receive, send)
                return
            gate = _StatusGate(send)
            try:
                # a copy each time: routing writes into the scope (a Mount extends root_path), and a replay
                # must be routed as the first attempt was
                await self.app(dict(scope), replay_receive, gate.send)
            except Exception:
                if not gate.held_503:
                    raise
            if not gate.held_503:
                return
            await asyncio.sleep(delay)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect: the client left; the app sees no body
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive() that gives `body` once, then waits on the real one (for http.disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _StatusGate:
    """Forwards an answer to the client unless its status is 503; a 503 answer is swallowed whole."""

    def __init__(self, send: Send):
        self._send = send
        self.held_503 = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            self.held_503 = True
        if not self.held_503:
            await self._send(message)


def create_replaying_app() -> App:
    """uvicorn factory: Prefect's server app behind ReplayOnConflict. `create_app` reads its settings and the
    temporary server's flags (PREFECT__SERVER_EPHEMERAL, PREFECT__SERVER_FINAL) from the environment, as it does
    when uvicorn calls it directly."""
    from prefect.server.api.server import create_app

    parent = os.environ.get(PARENT_PID_VARIABLE)
    if parent:
        watch_parent(int(parent))
    return ReplayOnConflict(create_app())


PREFECT_FACTORY = "prefect.server.api.server:create_app"
REPLAYING_FACTORY = f"{__name__}:{create_replaying_app.__name__}"


class _ReplayingPopen:
    """Stands in for the `subprocess` module inside prefect.server.api.server: a command that names Prefect's app
    factory is started with `create_replaying_app` in its place, at nice 19 (`yield_to_compute`), told to die
    with this process (PARENT_PID_VARIABLE); everything else is the real module's."""

    def Popen(self, args, *rest, **kwargs):  # noqa: N802 (the name subprocess has)
        serves_prefect = isinstance(args, list) and PREFECT_FACTORY in args
        if serves_prefect:
            args = [REPLAYING_FACTORY if a == PREFECT_FACTORY else a for a in args]
            kwargs["env"] = _with_parent_pid(kwargs.get("env"))
        process = subprocess.Popen(args, *rest, **kwargs)
        if serves_prefect:
            yield_to_compute(process.pid)
        return process

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def _with_parent_pid(env: Optional[dict[str, str]]) -> dict[str, str]:
    return {**(os.environ if env is None else env), PARENT_PID_VARIABLE: str(os.getpid())}


def yield_to_compute(pid: int) -> None:
    """Set process `pid` to nice TEMPORARY_SERVER_NICENESS (see the module docstring); a no-op where the OS has
    no setpriority. Called as soon as Popen returns, i.e. after the exec: the new interpreter has no thread but
    its first yet, and on Linux (where niceness is per thread) every thread it starts inherits the value.
    Raising one's own child's niceness needs no privilege."""
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, pid, TEMPORARY_SERVER_NICENESS)


def replay_on_temporary_server() -> bool:
    """Make Prefect's temporary server run `create_replaying_app` (idempotent). Its command is Prefect's own
    (`SubprocessASGIServer._run_uvicorn_command`: uvicorn, loopback, the UI off, the process's settings in its
    environment) with only the factory named differently, started at nice 19, dying with this process. False,
    changing nothing, when this process has an API URL (importing Prefect's server module costs ~1.6 s, which a
    process that starts the temporary server pays anyway), or when Prefect's module does not look as expected
    (its server then conflicts as before, and outlives a SIGKILL of this process).

    Works around, in Prefect 3.7.7: a SQLite lock conflict answered 503 with no Retry-After (the client waits
    2 s), and a temporary server stopped only from an atexit hook (module docstring). Installed by
    adaptations.install_process_adaptations; still needed while tests/unit/test_adaptations_prefect_server.py
    sees Prefect's client wait 2 s after a 503 and an unpatched temporary server outlive its SIGKILLed parent."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return False
    from prefect.server.api import server

    return install_stand_in(server, "subprocess", subprocess, _ReplayingPopen)


def serve_prefect_api(host: str, port: int, log_level: str = "info") -> None:
    """Run Prefect's server app (API and services) on host:port until interrupted. Blocks."""
    import uvicorn
    from prefect.server.api.server import create_app

    uvicorn.run(ReplayOnConflict(create_app(final=True)), host=host, port=port, log_level=log_level)
