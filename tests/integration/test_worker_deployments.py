"""Warm stage workers that a work pool starts (prefect.yaml's ppo-stage-worker deployments, flows/worker_flow.py), on
a real Prefect server and a real process pool, as the docs' commands set them up:

- `prefect deploy` the three worker deployments, `prefect worker start` a process pool worker, `prefect deployment
  run` each: three flow runs that stay Running;
- a training run with pipeline.stage_workers sends its stages there: each stage's manifest names a worker process
  that is one of those flow runs' processes (the pool worker's infrastructure pid), not the training process;
- the rollout worker's process SIGKILLed: Prefect marks its flow run Crashed, and the next training run's rollout
  fails by name once no worker has served it for pipeline.deadlines.pickup_s.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from bench.processes import REPO, create_process_pools, stop_workers
from tests.fixtures import warm_python
from tests.fixtures.warm_python import prefect_cli
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
POOL = "worker-pool"
WORKERS = {"rollout": "ppo-rollout-worker", "score": "ppo-score-worker", "update": "ppo-train-worker"}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}


def _wait_for(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _flow_run(client, flow_run_id):
    return client.read_flow_run(flow_run_id)


def test_a_work_pool_starts_warm_workers_that_train_and_crash_visibly(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from prefect import get_client

    from flows.training import ppo_training
    from storage.layout import layout_for
    from storage.stage_records import read_stage_record

    env = _env()
    create_process_pools(
        [POOL], prefect_api
    )  # `prefect work-pool create POOL --type process` (test_deploy_run runs it)
    names = [a for name in WORKERS.values() for a in ("--name", name)]
    out = prefect_cli("--no-prompt", "deploy", *names, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    pool_worker = warm_python.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process", "--limit", "4"],
        cwd=REPO,
        env=env,
        stdout=open(tmp_path / "pool-worker.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        runs = {}
        for stage, deployment in WORKERS.items():
            out = prefect_cli("deployment", "run", f"ppo-stage-worker/{deployment}", env=env)
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
            runs[stage] = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
        with get_client(sync_client=True) as client:

            def running():
                found = {s: _flow_run(client, r) for s, r in runs.items()}
                if all(f.state.is_running() and f.infrastructure_pid for f in found.values()):
                    return found

            found = _wait_for("the three worker flow runs to run", running, 240)
            pids = {s: int(f.infrastructure_pid.rsplit(":", 1)[-1]) for s, f in found.items()}

            # A training run whose stages go to those workers.
            pipeline = {"stage_workers": list(WORKERS), "deadlines": {"pickup_s": 20}}
            cfg = small_config(str(tmp_path / "runs"), "on-pool-workers", tiny_model_dir, digits_dataset_dir, 2,
                               pipeline=pipeline)  # fmt: skip
            state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
            assert state.is_completed(), f"{state}\n{(tmp_path / 'pool-worker.log').read_text()[-4000:]}"
            host = socket.gethostname()
            layout = layout_for(cfg)
            for stage, pid in pids.items():
                workers = {read_stage_record(layout, i, stage)["worker"] for i in (1, 2)}
                assert workers == {f"{host}:{pid}"}, (stage, workers, pids)
            assert os.getpid() not in pids.values()

            # The rollout worker dies: Prefect shows its flow run Crashed ...
            os.kill(pids["rollout"], signal.SIGKILL)
            crashed = _wait_for(
                "the killed worker's flow run to be Crashed",
                lambda: (f := _flow_run(client, runs["rollout"])).state.is_crashed() and f,
                120,
            )
            assert crashed.state.name == "Crashed"
            for stage in ("score", "update"):  # the others serve on
                assert _flow_run(client, runs[stage]).state.is_running()

            # ... and a training run's rollout, which no worker takes now, fails naming the stage. Its pickup_s counts
            # from the moment the server lists no rollout worker (the first run's 20 s gave the pool's workers time to
            # connect; none is to come here), so 5 s shows the same failure 15 s sooner (test_worker_kills's too).
            unserved = {**pipeline, "deadlines": {"pickup_s": 5}}
            later = small_config(str(tmp_path / "runs"), "no-rollout-worker", tiny_model_dir, digits_dataset_dir, 1,
                                 pipeline=unserved)  # fmt: skip
            state = ppo_training(config=later.model_dump(mode="json"), return_state=True)
            assert state.is_failed(), state
            assert "rollout" in state.message and "no worker serving it" in state.message, state.message
            for stage in ("score", "update"):
                client.set_flow_run_state(runs[stage], _cancelling(), force=True)
    finally:
        stop_workers([pool_worker], grace_s=20)


def _cancelling():
    from prefect.states import Cancelling

    return Cancelling()
