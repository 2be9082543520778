"""adaptations/prefect_server.py: ReplayOnConflict, driven through Prefect's real HTTP client
(PrefectHttpxAsyncClient, the one every Prefect API call goes through) over httpx's ASGI transport. The waits
the client chose are read from its own debug log: with the middleware a conflict that clears within the replays
costs the client nothing.
"""

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from adaptations.parent_watch import PARENT_POLL_S
from adaptations.prefect_server import ReplayOnConflict

REPO = Path(__file__).resolve().parents[2]
DELAYS = (0.0, 0.0, 0.0)  # the schedule is not under test; three replays, no sleeping


def _app_answering(statuses: list[int], raise_after_503: bool = False):
    """An ASGI app whose i-th HTTP request gets statuses[i] (the last one after that) and a JSON body echoing
    the request body it read. With raise_after_503 it raises after sending a 503, as Starlette's error
    middleware does after Prefect's handler answered."""
    seen: list = []
    roots: list = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            seen.append(scope["type"])
            return
        message = await receive()
        seen.append(message["body"])
        # routing writes into the scope, as Starlette's Mount does: a replay must not see the first one's
        roots.append(scope.get("root_path", ""))
        scope["root_path"] = scope.get("root_path", "") + "/api"
        status = statuses[min(len(seen) - 1, len(statuses) - 1)]
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"x")]})
        await send({"type": "http.response.body", "body": json.dumps({"echo": message["body"].decode()}).encode()})
        if status == 503 and raise_after_503:
            raise RuntimeError("database is locked")

    app.seen = seen
    app.roots = roots
    return app


def _post_through_prefect_client(app) -> tuple[httpx.Response, list[float]]:
    """POST a body through Prefect's client; (the response, the waits in s its retry loop logged)."""
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

        async def post():
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with PrefectHttpxAsyncClient(transport=transport, base_url="http://api") as c:
                response = await c.post("/task_runs/", content=b'{"name": "update-0"}')
                await response.aread()
                return response

        response = asyncio.run(post())
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    waits = [float(m) for r in records for m in re.findall(r"Another attempt will be made in ([0-9.]+)s", r)]
    return response, waits


@pytest.mark.parametrize("raise_after_503", [False, True])
def test_a_conflict_that_clears_is_replayed_by_the_server_and_the_client_never_waits(raise_after_503):
    app = _app_answering([503, 503, 200], raise_after_503)
    response, waits = _post_through_prefect_client(ReplayOnConflict(app, DELAYS))
    assert response.status_code == 200 and waits == []
    assert app.seen == [b'{"name": "update-0"}'] * 3  # the same body, read by every attempt
    assert app.roots == [""] * 3  # and the same scope
    assert response.json() == {"echo": '{"name": "update-0"}'}


def test_a_conflict_that_outlasts_the_replays_reaches_the_client_which_backs_off_as_before():
    from prefect.settings import PREFECT_CLIENT_RETRY_JITTER_FACTOR

    jitter = PREFECT_CLIENT_RETRY_JITTER_FACTOR.value()
    # 1 + 3 replays answered 503 on the client's first send, then 200 on its retry
    app = _app_answering([503] * 4 + [200])
    response, waits = _post_through_prefect_client(ReplayOnConflict(app, DELAYS))
    assert response.status_code == 200 and len(app.seen) == 5
    assert len(waits) == 1 and waits[0] >= 2 * (1 - jitter) - 1e-9  # Prefect's own 2**1 s back-off, kept


def test_the_before_without_the_middleware_one_conflict_costs_the_client_2_s():
    from prefect.settings import PREFECT_CLIENT_RETRY_JITTER_FACTOR

    jitter = PREFECT_CLIENT_RETRY_JITTER_FACTOR.value()
    response, waits = _post_through_prefect_client(_app_answering([503, 200]))
    assert response.status_code == 200 and len(waits) == 1 and waits[0] >= 2 * (1 - jitter) - 1e-9


def test_other_answers_and_lifespan_pass_through_once():
    app = _app_answering([201])
    response, waits = _post_through_prefect_client(ReplayOnConflict(app, DELAYS))
    assert response.status_code == 201 and waits == [] and len(app.seen) == 1

    lifespan = _app_answering([200])

    async def nothing():
        return {"type": "lifespan.startup"}

    async def drop(message):
        pass

    asyncio.run(ReplayOnConflict(lifespan, DELAYS)({"type": "lifespan"}, nothing, drop))
    assert lifespan.seen == ["lifespan"]


# --- Prefect's temporary server (the embedded default) runs the replaying app ---------------------------------

_START_TEMPORARY_SERVER = """
import json, os, sys
from adaptations import install_process_adaptations

install_process_adaptations()  # as every entry point that runs ppoflow's flows does
from prefect.client.orchestration import get_client
from prefect.server.api.server import SubprocessASGIServer

with get_client(sync_client=True) as client:  # Prefect's own path to its temporary server
    healthy = client.api_healthcheck() is None
(server,) = [s for s in SubprocessASGIServer._instances.values() if s.server_process]
pid = server.server_process.pid
with open(f"/proc/{pid}/cmdline", "rb") as f:
    argv = f.read().decode().split("\\0")
niceness = {}  # per thread: field 19 of /proc/<pid>/task/<tid>/stat (the 17th after the command's closing paren)
for tid in os.listdir(f"/proc/{pid}/task"):
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        niceness[tid] = int(f.read().rsplit(")", 1)[1].split()[16])
server.stop()
print(json.dumps({"healthy": healthy, "argv": argv, "niceness": niceness, "own": os.nice(0)}))
"""


# As cli/main.py sets it: a temporary server's first start (database migrations) took over Prefect's default 20 s
# on the shared 2-core machine.
SLOW_START = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}


def _python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **SLOW_START, "PREFECT_HOME": str(tmp_path / "prefect-home"), **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_temporary_server_prefect_starts_without_an_api_url_is_the_replaying_app_at_nice_19(tmp_path):
    out = _python(_START_TEMPORARY_SERVER, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    started = json.loads(out.stdout.strip().splitlines()[-1])
    assert started["healthy"]
    argv = started["argv"]
    # Prefect's command (uvicorn on loopback) with only the factory changed
    assert argv[argv.index("--factory") + 1] == "adaptations.prefect_server:create_replaying_app"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "uvicorn" in argv
    # ...at the lowest priority, every thread of it (uvicorn's loop, the database threads), while this run's own
    # process keeps its priority
    assert started["own"] < 19 and len(started["niceness"]) > 1
    assert set(started["niceness"].values()) == {19}


def test_with_an_api_url_nothing_is_changed_and_prefects_server_module_is_not_loaded(tmp_path):
    code = (
        "import sys\n"
        "from adaptations.prefect_server import replay_on_temporary_server\n"
        "print(replay_on_temporary_server(), 'prefect.server.api.server' in sys.modules)\n"
    )
    out = _python(code, tmp_path, PREFECT_API_URL="http://127.0.0.1:9/api")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False"]


_UNADAPTED_TEMPORARY_SERVER = """
import os, signal
import tasks  # ppoflow's packages: importing them must adapt nothing
from prefect.client.orchestration import get_client
from prefect.server.api.server import SubprocessASGIServer

with get_client(sync_client=True) as client:
    client.api_healthcheck()
(server,) = [s for s in SubprocessASGIServer._instances.values() if s.server_process]
print(server.server_process.pid, os.nice(0), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer's way: no atexit hook runs
"""


def test_upstream_still_leaves_its_temporary_server_running_after_a_sigkill_of_the_run(tmp_path):
    """Prefect 3.7.7 without the adaptation (and nothing installed by importing ppoflow): the temporary server
    keeps running once the process that started it is SIGKILLed, at that process's priority. Fails once Prefect
    ties the server's life to its parent itself: then `watch_parent` can go."""
    clean = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as err:  # a file, not a pipe: the orphaned server inherits it and keeps it open
        run = subprocess.Popen(
            [sys.executable, "-c", _UNADAPTED_TEMPORARY_SERVER],
            env={**clean, **SLOW_START, "PREFECT_HOME": str(tmp_path / "prefect-home")},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        first = run.stdout.readline()  # not read to its end: the server holds that pipe too
        assert run.wait(timeout=240) == -9, stderr.read_text()[-3000:]
    pid, parent_nice = map(int, first.split())
    try:
        time.sleep(3 * PARENT_POLL_S + 2)  # the adapted server is gone by then (test_temporary_server_dies_with_run)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        with open(f"/proc/{pid}/stat") as f:
            nice = int(f.read().rsplit(")", 1)[1].split()[16])
        assert "prefect.server.api.server:create_app" in argv  # Prefect's own factory, still running
        assert nice == parent_nice  # and not lowered
    finally:
        _stop(pid)


def _stop(pid: int) -> None:
    """SIGTERM, then SIGKILL, the orphaned server this test made (nobody else would stop it)."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)


# --- `ppoflow prefect-server` as a user starts it: no telemetry ---------------------------------------------

WATCH_S = 20.0  # Prefect's telemetry service sends its first heartbeat at start-up (measured: ~8 s after its banner)
WATCH_AFTER_HEALTHY_S = 12.0  # on a loaded machine, where start-up itself is slow: as long after /api/health answers
START_DEADLINE_S = 120.0  # a slow host took 22 s to listen at all (import and database set-up), past WATCH_S


def test_ppoflow_prefect_server_starts_without_a_telemetry_error(tmp_path):
    """The user's environment, less PREFECT_API_URL and any PREFECT_SERVER_ANALYTICS_ENABLED (the test server
    of tests/fixtures sets it, which hid this). HTTPS_PROXY points at a closed port, so a heartbeat fails here
    as it does offline, whatever this machine's network: before the fix the server logged
    `ERROR | prefect.server.services.telemetry - Failed to send telemetry: ...`."""
    import socket
    import threading
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost",
    )
    ppoflow = Path(sys.executable).parent / "ppoflow"
    proc = subprocess.Popen(
        [str(ppoflow), "prefect-server", "--host", "127.0.0.1", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    started, healthy_after = time.time(), None
    try:
        while proc.poll() is None and (
            time.time() - started < START_DEADLINE_S
            if healthy_after is None
            else time.time() - started < max(WATCH_S, healthy_after + WATCH_AFTER_HEALTHY_S)
        ):
            if healthy_after is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                        healthy_after = time.time() - started
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=10)
    assert healthy_after is not None, "".join(lines)[-3000:]
    assert any("Uvicorn running on" in line for line in lines), lines  # the output was read
    noise = [line for line in lines if "ERROR" in line or "telemetry" in line.lower()]
    assert noise == [], "".join(lines)[-3000:]
