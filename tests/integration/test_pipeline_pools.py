"""Deploy with prefect.yaml to process work pools on the loopback server, start a worker per pool, run
the training deployment with stage pools configured, and find each stage's flow run on its own pool."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from bench.processes import POOLS, REPO, STAGE_POOLS, create_process_pools, stop_workers
from tests.fixtures import warm_python
from tests.fixtures.warm_python import prefect_cli
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
EXPECTED_POOL = {
    "ppo-rollout": "rollout-pool",
    "ppo-score": "score-pool",
    "ppo-update": "train-pool",
    "ppo-checkpoint": "train-pool",
    "ppo-training": "ppoflow-pool",
}


def test_stages_run_on_their_own_pools(prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime
    from prefect.deployments import run_deployment

    from flows.deployment import DEPLOYMENT_NAME

    # Workers are separate processes: they must not inherit this test process's torch.distributed
    # rendezvous (MASTER_PORT is still bound by the trainer that earlier tests set up here).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    }
    env["PREFECT_API_URL"] = prefect_api
    # The server is shared: other tests leave deployment runs of these flows on it (test_deploy_run's failing one,
    # say); only the runs created from here on are this test's.
    since = datetime.now(timezone.utc)
    create_process_pools(POOLS, prefect_api)  # `prefect work-pool create P --type process`, without 5 processes
    out = prefect_cli("--no-prompt", "deploy", "--all", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    workers = [
        warm_python.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process", "--limit", "1"],
            cwd=REPO,
            env=env,
            stdout=open(tmp_path / f"{pool}.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for pool in POOLS
    ]
    try:
        cfg = small_config(
            str(tmp_path / "runs"),
            "pools",
            tiny_model_dir,
            digits_dataset_dir,
            iterations=1,
            pipeline={"stage_pools": STAGE_POOLS},
        )
        run = run_deployment(
            "ppo-training/ppo-training",
            parameters={"config": cfg.model_dump(mode="json")},
            timeout=900,
            poll_interval=3,
        )
        logs = "\n".join((tmp_path / f"{p}.log").read_text()[-2000:] for p in POOLS)
        assert run.state is not None and run.state.is_completed(), f"{run.state}\n{logs}"
        with get_client(sync_client=True) as client:
            # filtered by the server: a page of all runs can miss some once the shared server holds hundreds
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)))
            flows = {f.id: f.name for f in client.read_flows(limit=200)}
            # `ppoflow train` runs of other tests on this server are runs of its own served deployment (no pool)
            served = {d.id for d in client.read_deployments() if d.name == DEPLOYMENT_NAME}
        by_flow: dict[str, list] = {}
        for fr in runs:
            by_flow.setdefault(flows[fr.flow_id], []).append(fr)
        for flow_name, pool in EXPECTED_POOL.items():
            found = [
                fr
                for fr in by_flow.get(flow_name, [])
                if fr.deployment_id not in (None, *served) and fr.created is not None and fr.created >= since
            ]
            assert found, f"no deployment run of {flow_name}; flows seen: {sorted(by_flow)}"
            assert all(fr.work_pool_name == pool for fr in found), [(fr.name, fr.work_pool_name) for fr in found]
            assert all(fr.state.is_completed() for fr in found), [(fr.name, fr.state) for fr in found]
        assert (tmp_path / "runs" / "pools" / "checkpoints" / "iter-000001" / "_COMMITTED").exists()
    finally:
        stop_workers(workers)


def test_a_stage_that_fails_on_its_pool_gives_its_own_error_to_the_training_run(prefect_api, tmp_path, tiny_model_dir):
    # Issue 56: the training run's state said only "StageFailed: ... checkpoint-iter-1 ... ended FAILED"; the
    # stage's own error (here the checkpoint stage's CheckpointError: nothing was staged) was one click away.
    from flows.failure import StageError
    from runtime.pool_deployments import PoolDeployments
    from runtime.stage_runs import StageFailed
    from stages.manifests import UpdateManifest

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PREFECT_API_URL"] = prefect_api
    create_process_pools(["train-pool"], prefect_api)
    out = prefect_cli("--no-prompt", "deploy", "--name", "ppo-checkpoint", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    worker = warm_python.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "train-pool", "--type", "process"],
        cwd=REPO,
        env=env,
        stdout=open(tmp_path / "worker.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    cfg = small_config(str(tmp_path / "runs"), "pool-error", tiny_model_dir, tmp_path / "data", iterations=1)
    update = UpdateManifest(
        iteration=1,
        seconds=0.0,
        worker="test:0",
        engine_builds=0,
        checkpoint_uri=str(tmp_path / "runs" / "pool-error" / "checkpoints" / "iter-000001"),
        experience_uri=str(tmp_path / "nowhere"),
        weights_id="ckpt-none",
        experience_hash="none",
        metrics={},
    )
    try:
        with pytest.raises(StageFailed) as failed:
            PoolDeployments(cfg).run_on("ppo-checkpoint/ppo-checkpoint", "checkpoint", 1, update=update)
    finally:
        stop_workers([worker])
    assert failed.value.stage_error and failed.value.stage_error.startswith("CheckpointError: "), failed.value
    message = str(StageError("checkpoint", 1, failed.value))  # what ppo_iteration raises, the runs' state message
    assert message.startswith(f"checkpoint stage of iteration 1 failed: {failed.value.stage_error} (flow run ")
    assert "on deployment 'ppo-checkpoint/ppo-checkpoint')" in message and "StageFailed" not in message
