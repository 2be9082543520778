"""A fork started from the Prefect UI: `ppoflow serve` serves `ppo-fork/ppoflow-fork` beside the training deployment
(flows/deployment.py), and a flow run of it created as the UI's "Run" form creates one (Scheduled, the parameters
run, at, name, root, set) is executed by it: the fork is made and trained as a subflow run.

Real Prefect server on loopback, `ppoflow serve` as a child process, tiny model, CPU. Checked: the run Completes,
the fork's iteration 3 trained under its own kl_coef from the parent's checkpoint 2; a second run whose `set`
changes run.seed ends Failed with the message naming run.seed, and makes no fork folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures import warm_python
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _wait_final(client, flow_run_id, timeout_s: float):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        time.sleep(2)
    return client.read_flow_run(flow_run_id)


def _deployment(client, name: str, timeout_s: float = 120):
    deadline = time.time() + timeout_s
    while True:
        try:
            return client.read_deployment_by_name(name)
        except Exception:  # noqa: BLE001 - Prefect's ObjectNotFound until `ppoflow serve` registered it
            if time.time() > deadline:
                raise
            time.sleep(1)


def test_a_fork_started_as_a_run_of_the_fork_deployment(prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir):
    from prefect.client.orchestration import get_client

    from flows.training import ppo_training
    from storage.checkpoints import latest_iteration
    from storage.layout import RunLayout
    from storage.metrics import read_metrics
    from storage.run_identity import read_run_record

    root = str(tmp_path / "root")
    base = small_config(root, "base", tiny_model_dir, digits_dataset_dir, iterations=2)
    assert ppo_training(config=base.model_dump(mode="json"), return_state=True).is_completed()

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    log = open(tmp_path / "serve.log", "w")
    serve = warm_python.Popen(
        [sys.executable, "-m", "cli", "serve"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        with get_client(sync_client=True) as client:
            deployment = _deployment(client, "ppo-fork/ppoflow-fork")
            changes = ["algo.kl_coef=0.5", "run.iterations=3"]
            ui_run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"run": "base", "at": 2, "name": "ui-fork", "root": root, "set": changes}
            )
            refused = client.create_flow_run_from_deployment(
                deployment.id, parameters={"run": "base", "at": 2, "name": "bad", "root": root, "set": ["run.seed=5"]}
            )
            ui_run = _wait_final(client, ui_run.id, 500)
            refused = _wait_final(client, refused.id, 120)
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    served = (tmp_path / "serve.log").read_text()[-3000:]
    assert ui_run.state.is_completed(), (ui_run.state, served)
    fork = RunLayout(root, "ui-fork")
    assert read_run_record(fork)["parent"]["iteration"] == 2 and latest_iteration(fork) == 3
    assert [(row["iteration"], row["kl/coef"]) for row in read_metrics(fork)] == [(3, 0.5)]
    assert refused.state.is_failed() and "run.seed" in (refused.state.message or ""), (refused.state, served)
    assert not Path(root, "bad").exists()
