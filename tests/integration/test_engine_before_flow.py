"""`train` builds the rollout engine before the flow starts (flows/run.py), while Prefect's temporary server starts.

What a user would see go wrong, and what each test checks from the outside (a wrapper around the registry's
`_build`, recording where and when each build ran):
- a fresh run builds the engine once, on the thread that runs the stage bodies, before any flow run exists, and the
  rollout stages of both iterations use it (no second build);
- a resumed run does not build the initial policy's engine it would not use;
- a build that fails before the flow is left to the rollout stage, which builds again; the run still trains;
- Prefect's temporary server is started while the block runs (the overlap) and answers when the block ends.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console

from engines.rollout import registry
from tests.integration.pipeline_helpers import small_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def builds(monkeypatch):
    """[(on the main thread, inside a flow run)] per engine build; the engines are shut down after the test."""
    from prefect.context import FlowRunContext

    seen: list[tuple[bool, bool]] = []
    original = registry._build
    fail_first = {"on": False}

    def recording(*args, **kwargs):
        seen.append((threading.current_thread() is threading.main_thread(), FlowRunContext.get() is not None))
        if fail_first["on"]:
            fail_first["on"] = False
            raise RuntimeError("no memory for the KV cache (injected)")
        return original(*args, **kwargs)

    registry.shutdown_all()
    monkeypatch.setattr(registry, "_build", recording)
    yield seen, fail_first
    registry.shutdown_all()


def _train(cfg):
    from flows.run import train

    return train(cfg, console=Console(file=io.StringIO(), width=200, color_system=None))


def _metrics_iterations(cfg) -> list[int]:
    from flows.records import read_metrics
    from storage.layout import layout_for

    return [int(row["iteration"]) for row in read_metrics(layout_for(cfg))]


def test_a_fresh_run_builds_the_engine_once_before_the_flow_and_a_resume_builds_none_early(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, builds
):
    seen, _ = builds
    cfg = small_config(str(tmp_path / "runs"), "early", tiny_model_dir, digits_dataset_dir, iterations=2)
    _train(cfg)
    assert seen == [(True, False)]  # one build, on the main thread, before the flow; both rollouts used it
    assert _metrics_iterations(cfg) == [1, 2]

    registry.shutdown_all()  # a new process resuming the run: no engine yet
    _train(cfg.model_copy(update={"run": cfg.run.model_copy(update={"iterations": 3})}))
    assert seen == [(True, False), (True, True)]  # the resume's one build is the stage's, for checkpoint 2


def test_a_failed_early_build_is_left_to_the_rollout_stage(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, builds, caplog
):
    seen, fail_first = builds
    fail_first["on"] = True
    cfg = small_config(str(tmp_path / "runs"), "early-fails", tiny_model_dir, digits_dataset_dir, iterations=1)
    with caplog.at_level(logging.WARNING, logger="ppoflow.rollout"):
        _train(cfg)
    assert seen == [(True, False), (True, True)]  # the early build raised; the stage built it again
    assert _metrics_iterations(cfg) == [1]
    assert any("injected" in r.getMessage() and "builds it again" in r.getMessage() for r in caplog.records)


SERVER_SCRIPT = """
import time, httpx
from prefect.server.api.server import SubprocessASGIServer
from runtime.prefect_api import temporary_server_starting

with temporary_server_starting():
    time.sleep(0.5)
    server = SubprocessASGIServer._instances.get(None)
    print("starting-in-block", server is not None and server.running and server.server_process.poll() is None)
print("health", httpx.get(SubprocessASGIServer().api_url + "/health").status_code)
"""


def test_the_temporary_server_starts_during_the_block_and_answers_after_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    # the start-up allowance every ppoflow entry point gives the temporary server (flows/logs.prepare_flow_process):
    # Prefect's own 30 s is not enough on a busy 2-core machine
    env.update(
        PYTHONPATH=str(REPO),
        PREFECT_HOME=str(tmp_path / "prefect"),
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
    )
    result = subprocess.run(
        [sys.executable, "-c", SERVER_SCRIPT], env=env, capture_output=True, text=True, timeout=180, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["starting-in-block"] == "True"  # its process ran while the block's own work did
    assert lines["health"] == "200"  # and it answers once the block is left


def test_the_engine_is_built_early_only_where_the_flow_thread_runs_the_rollout(
    tmp_path, tiny_model_dir, digits_dataset_dir
):
    from flows.run import _builds_rollout_here

    def cfg(**sections):
        return small_config(str(tmp_path / "runs"), "where", tiny_model_dir, digits_dataset_dir, **sections)

    assert _builds_rollout_here(cfg())
    assert not _builds_rollout_here(cfg(pipeline={"max_staleness": 1}))  # stages on the task runner's threads
    assert not _builds_rollout_here(cfg(pipeline={"stage_workers": ["rollout"]}))  # a warm worker samples
    assert not _builds_rollout_here(cfg(model={"policy_path": str(tmp_path / "absent")}))  # preflight refuses it
