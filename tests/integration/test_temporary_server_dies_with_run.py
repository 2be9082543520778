"""`ppoflow train` on the embedded default (no PREFECT_API_URL) starts Prefect's temporary server; SIGKILL of the
`ppoflow train` process alone (what the OOM killer does) takes that server down with it within seconds
(adaptations/prefect_server.py `watch_parent`). Before, the server was stopped only by Prefect's atexit hook, which
SIGKILL never runs: this test failed on the server still answering.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from storage.liveness import pid_alive
from tests.integration.pipeline_helpers import small_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PREFECT_API_URL")
GONE_WITHIN_S = 15  # the watch polls every 0.5 s, then the server shuts down as on SIGTERM


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _answering_server(train: subprocess.Popen, log: Path) -> tuple[int, str]:
    """(pid, health URL) of the uvicorn child of `train` once it answers /api/health."""
    deadline = time.monotonic() + 300
    while True:
        assert train.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no temporary server answered in 300 s"
        for pid in _children(train.pid):
            argv = _argv(pid)
            if "uvicorn" in argv and "--port" in argv:
                url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/api/health"
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        return pid, url
                except httpx.HTTPError:
                    pass
        time.sleep(0.2)


def test_sigkill_of_ppoflow_train_takes_its_temporary_prefect_server_down(tmp_path, tiny_model_dir, digits_dataset_dir):
    cfg = small_config(str(tmp_path / "runs"), "orphan", tiny_model_dir, digits_dataset_dir, iterations=50)
    config_path = tmp_path / "orphan.yaml"
    config_path.write_text(cfg.to_yaml())
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    log = tmp_path / "train.log"
    with open(log, "w") as out:  # a file, not a pipe: the server inherits it and may outlive the command
        train = subprocess.Popen(
            [sys.executable, "-m", "cli", "train", str(config_path)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = None
    try:
        server, url = _answering_server(train, log)
        train.send_signal(signal.SIGKILL)
        train.wait(timeout=30)
        killed_at = time.monotonic()
        while pid_alive(server) and time.monotonic() - killed_at < GONE_WITHIN_S:
            time.sleep(0.2)
        gone_s = time.monotonic() - killed_at
        assert not pid_alive(server), f"the temporary server outlived `ppoflow train` by {GONE_WITHIN_S} s"
        print(f"temporary server gone {gone_s:.1f} s after the SIGKILL")
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=2)
    finally:
        if train.poll() is None:
            train.kill()
        if server is not None and pid_alive(server):
            os.kill(server, signal.SIGKILL)  # do not leave it behind for the next test either
