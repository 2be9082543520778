"""The vLLM plugin that makes the engine core die with its client (adaptations/vllm_client_watch.py), on real
processes: a client that starts a child inside `client_named` and one after it, then is SIGKILLed. The child
started inside follows it within the watch's poll; the other one is left alone. And the entry point is
installed where vLLM looks for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

from adaptations.parent_watch import PARENT_POLL_S
from storage.liveness import pid_alive

REPO = Path(__file__).resolve().parents[2]
CHILD = (
    "import sys, time\n"
    "from adaptations.vllm_client_watch import watch_client\n"
    "print(watch_client(), flush=True)\n"
    "time.sleep(600)\n"
)
# The client: one child inside client_named (as vLLM's engine core is started), one after it; prints
# "<pid> <what watch_client returned>" for each once both have called it.
CLIENT = (
    "import subprocess, sys, time\n"
    "from adaptations.vllm_client_watch import client_named\n"
    f"child = [sys.executable, '-c', {CHILD!r}]\n"
    "with client_named():\n"
    "    inside = subprocess.Popen(child, stdout=subprocess.PIPE, text=True)\n"
    "after = subprocess.Popen(child, stdout=subprocess.PIPE, text=True)\n"
    "for p in (inside, after):\n"
    "    print(p.pid, p.stdout.readline().strip(), flush=True)\n"
    "time.sleep(600)\n"
)


def test_the_child_started_inside_client_named_dies_with_its_sigkilled_client():
    client = subprocess.Popen([sys.executable, "-c", CLIENT], cwd=REPO, stdout=subprocess.PIPE, text=True)
    children = []
    try:
        (inside, inside_watching), (after, after_watching) = (client.stdout.readline().split() for _ in range(2))
        inside, after = int(inside), int(after)
        children = [inside, after]
        assert (inside_watching, after_watching) == ("True", "False")
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=30)
        deadline = time.monotonic() + 10 * PARENT_POLL_S + 5
        while pid_alive(inside) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(inside), "the child started inside client_named outlived its SIGKILLed client"
        assert pid_alive(after), "a child started outside client_named stopped with the client"
    finally:
        if client.poll() is None:
            client.kill()
        for pid in children:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_client_itself_and_a_process_without_the_variable_start_no_watch(monkeypatch):
    import adaptations.vllm_client_watch as watch

    monkeypatch.setattr(watch, "_watching", False)
    monkeypatch.delenv(watch.CLIENT_PID_VARIABLE, raising=False)
    assert watch.watch_client() is False
    with watch.client_named():  # the client's own plugin call: its parent is not itself
        assert os.environ[watch.CLIENT_PID_VARIABLE] == str(os.getpid())
        assert watch.watch_client() is False
    assert watch.CLIENT_PID_VARIABLE not in os.environ


def test_the_plugin_is_registered_where_vllm_looks():
    values = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "adaptations.vllm_client_watch:watch_client" in values
