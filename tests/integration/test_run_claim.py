"""Two `ppoflow train` commands on one run: the second is refused at once while the first trains; a start after
a SIGKILLed one takes the run over (runtime/stale_runs.py).

1. start 1 holds the run: it waits (tests/fixtures/hold_cli.py) inside the training flow, after its claim;
2. start 2, the same command, is refused before any work: status 2, one `ppoflow: error:` naming start 1's pid
   and host; start 1's claim stays;
3. start 1 goes on and finishes normally; its claim is released;
4. start 3 is SIGKILLed inside the flow (tests/fixtures/kill_cli.py), its claim left behind;
5. start 4 takes the run over: status 0, start 3's flow run marked Crashed, the claim released at its end.
Before the claim, start 2 trained beside start 1 (this test failed on its status 0).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures import warm_python
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
AFTER_CLAIM = "flows.training:start_progress@1"  # called in the flow after the claim, before any iteration


def _train(config_path: Path, *fixture: str, wait: bool = True):
    """`ppoflow train CONFIG` in a child process, through tests/fixtures/<fixture> when given."""
    entry = ["cli"] if not fixture else [f"tests.fixtures.{fixture[0]}", *fixture[1:]]
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    command = [sys.executable, "-m", *entry, "train", str(config_path)]
    if wait:
        return warm_python.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_claim(record_path: Path, process: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 300
    while True:
        if record_path.is_file():
            record = json.loads(record_path.read_text())
            if record["pid"] == process.pid:
                return record
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first start claimed no run in 300 s"
        time.sleep(0.2)


def test_a_second_start_is_refused_while_the_first_trains_and_takes_over_after_a_kill(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from prefect.client.orchestration import get_client

    from flows.records import read_metrics
    from storage.layout import layout_for

    cfg = small_config(str(tmp_path / "runs"), "claimed", tiny_model_dir, digits_dataset_dir, iterations=1)
    config_path = tmp_path / "claimed.yaml"
    config_path.write_text(cfg.to_yaml())
    layout = layout_for(cfg)
    record_path = Path(layout.run_dir) / "_active.json"
    go = tmp_path / "go"

    first = _train(config_path, "hold_cli", AFTER_CLAIM, str(go), wait=False)
    try:
        claim = _wait_for_claim(record_path, first)
        refused_at = time.monotonic()
        second = _train(config_path)
        refused_s = time.monotonic() - refused_at
        assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
        error = [line for line in second.stdout.splitlines() if line.startswith("ppoflow: error:")]
        assert len(error) == 1 and "RunClaimedError" in error[0], second.stdout[-3000:]
        assert f"pid {first.pid} on host {socket.gethostname()}" in error[0], error
        assert claim["flow_run_id"] in error[0] and f"kill {first.pid}" in error[0], error
        assert "Traceback" not in second.stdout
        assert json.loads(record_path.read_text()) == claim  # the refused start left the claim alone
        assert not (Path(layout.run_dir) / "iter-0001").exists()  # nothing trained meanwhile
        print(f"second start refused after {refused_s:.1f} s")

        go.touch()
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, out[-3000:] + err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert [row["iteration"] for row in read_metrics(layout)] == [1]
    assert not record_path.exists()  # released when the flow ended

    third = _train(config_path, "kill_cli", AFTER_CLAIM, wait=False)
    third.communicate(timeout=300)
    assert third.returncode == -signal.SIGKILL
    killed = json.loads(record_path.read_text())
    assert killed["pid"] == third.pid

    fourth = _train(config_path)
    assert fourth.returncode == 0, fourth.stdout[-3000:] + fourth.stderr[-3000:]
    assert not record_path.exists()
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(killed["flow_run_id"]).state
    assert state.type.value == "CRASHED" and f"pid {third.pid}" in state.message, state
