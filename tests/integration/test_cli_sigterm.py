"""`ppoflow demo` stopped with SIGTERM (a batch scheduler's stop, `kill PID`) on the embedded default: it ends
with the one failure message and exit status 143, and Prefect's temporary server, which the run started, ends
with it. Before, Python died at once on SIGTERM (no atexit hook ran) and left that server process running
for good; this test failed there on the server still being alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.liveness import pid_alive
from tests.integration.test_cli_terminal import SMALL

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sigterm_stops_the_run_and_its_temporary_prefect_server(tmp_path, tiny_model_dir, digits_dataset_dir):
    root = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.pop("MASTER_PORT", None)
    env.pop("PREFECT_API_URL", None)  # the embedded default: the run starts Prefect's temporary server
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp_path / "prefect-home"), COLUMNS="120")
    args = [sys.executable, "-m", "cli", "demo", "--root", str(root), "--iterations", "200"]
    for item in [f"model.policy_path={tiny_model_dir}", f"data.path={digits_dataset_dir}", *SMALL]:
        args += ["--set", item]
    demo = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = root / "demo" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):  # two iterations committed
            assert demo.poll() is None, demo.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the demo committed no two iterations in 300 s"
            time.sleep(0.2)
        servers = [p for p in _children(demo.pid) if "uvicorn" in _cmdline(p)]
        assert len(servers) == 1, [_cmdline(p) for p in _children(demo.pid)]
        demo.send_signal(signal.SIGTERM)
        stdout, stderr = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()  # reaped: no zombie left under this test process for the next test's process listings
    deadline = time.monotonic() + 30
    while pid_alive(servers[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = pid_alive(servers[0])
    if alive:
        os.kill(servers[0], signal.SIGKILL)  # do not leave it behind for the next test either
    assert not alive, "Prefect's temporary server outlived the run stopped by SIGTERM"
    assert demo.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "ppoflow: error: Terminated: stopped by SIGTERM" in stdout, stdout[-3000:]
    assert "resume:  ppoflow demo --root" in stdout and "Traceback" not in stdout
