"""A warm worker whose subscription handshake times out subscribes again instead of exiting.

The worker reaches the real loopback Prefect server through a TCP relay (this file) that holds the first
websocket handshake to /task_runs/subscriptions/scheduled open without answering, so the client's opening
handshake times out (websockets' open_timeout, 10 s), as it does when a server is too busy to answer or the
worker's process was stopped mid-handshake. Every other connection is relayed. Prefect's own task worker exits
on that TimeoutError; the warm worker (runtime/workers.py) must log it, subscribe again and run the task a test
submits afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest

from tests.fixtures.echo_task import echo

pytestmark = pytest.mark.slow


class HandshakeStaller:
    """Loopback relay to `upstream` (host, port) that leaves the first `stalls` subscription handshakes unanswered."""

    def __init__(self, upstream: tuple[str, int], stalls: int = 1):
        self.upstream, self.stalls, self.stalled = upstream, stalls, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        first = client.recv(65536)
        if b"/task_runs/subscriptions/scheduled" in first and len(self.stalled) < self.stalls:
            self.stalled.append(client)  # held open, never answered
            return
        upstream = socket.create_connection(self.upstream)
        upstream.sendall(first)
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        self.listener.close()
        for s in self.stalled:
            s.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_worker_subscribes_again_after_a_handshake_timeout(prefect_api, caplog):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from adaptations.prefect_task_worker import SlotTaskWorker

    host, port = prefect_api.split("//", 1)[1].split("/", 1)[0].split(":")
    relay = HandshakeStaller((host, int(port)))
    relayed_url = prefect_api.replace(f"{host}:{port}", f"127.0.0.1:{relay.port}")
    errors: list[BaseException] = []
    loop = asyncio.new_event_loop()

    def serve() -> None:
        async def run() -> None:
            worker = SlotTaskWorker(echo, limit=1)
            await worker.astart()

        with temporary_settings(updates={PREFECT_API_URL: relayed_url}):
            try:
                loop.run_until_complete(run())
            except BaseException as e:  # the worker exited: what Prefect's own worker does here
                errors.append(e)

    caplog.set_level(logging.WARNING, logger="prefect.task_worker")
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        # as runtime/stage_runs.py submits: the submission (Prefect's run context) pickled, the result JSON
        future = echo.with_options(result_serializer="pickle").delay(41)
        for _ in range(90):  # the worker exiting (the failure this test is about) ends the wait at once
            if errors or future.state.is_final():
                break
            time.sleep(1)
        assert not errors, f"the worker exited: {errors!r}"
        assert future.result(timeout=10) == 41
        assert relay.stalled, "the relay never saw the worker's subscription: the test proved nothing"
        assert not errors, errors
        # The stalled handshake may be the presence subscription's (runtime/workers.py holds two, and which connects
        # first is a race): the task then runs at once, and the stall is logged when its open_timeout (10 s) ends.
        logged = lambda: any(  # noqa: E731
            "TimeoutError" in r.getMessage() and "trying again" in r.getMessage() for r in caplog.records
        )
        for _ in range(30):
            if logged() or errors:
                break
            time.sleep(1)
        assert not errors, f"the worker exited: {errors!r}"
        assert logged()
    finally:
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=20)
        relay.close()
