"""Stage deadlines on the real CLI and a real Prefect server (tasks/deadlines.py, runtime/pool_deployments.py).

- A stage stuck in Python (tests/fixtures/hang_cli.py, `python`) is interrupted at its deadline, fails by name,
  and Prefect's retry reruns it: the run completes, its metrics rows equal an uninterrupted run's.
- A stage blocked in native code (`native`) ends its process grace_s after the deadline with one message naming
  it (exit code 124); `ppoflow train` again resumes from the last checkpoint and completes.
- A stage sent to a work pool that has no worker fails naming the pool, within pickup_s, its flow run cancelled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.processes import create_process_pools
from tests.fixtures import warm_python
from tests.integration.pipeline_helpers import small_config
from tests.integration.test_pipeline_crash import _DISTRIBUTED_VARS, COMPARED, REPO

pytestmark = pytest.mark.slow
UPDATE_DEADLINE_S = 20  # far above a toy update (1-5 s on 2 cores), far below the hang; each hang waits it out
HANG_AT = "stages.update:run_update@2"  # iteration 2's update (iteration 1's has the start-up)


def _config_file(tmp_path: Path, name: str, model_dir, data_dir, **deadlines) -> Path:
    settings = {"stages": {"update": UPDATE_DEADLINE_S}, **deadlines}  # one retry: what takes over at the deadline
    cfg = small_config(
        str(tmp_path / "runs"), name, model_dir, data_dir, iterations=2, pipeline={"retries": 1, "deadlines": settings}
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _train(config_path: Path, *hang: str, fresh: bool = False) -> subprocess.CompletedProcess:
    """`ppoflow train CONFIG` in a child process; with `hang` = (spec, mode), through tests.fixtures.hang_cli. Forked
    from the test zygote (tests/fixtures/warm_python.py) but for the `fresh` reference run."""
    entry = ["tests.fixtures.hang_cli", *hang] if hang else ["cli"]
    return (subprocess.run if fresh else warm_python.run)(
        [sys.executable, "-m", *entry, "train", str(config_path)],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _rows(tmp_path: Path, name: str) -> list[dict]:
    from flows.records import read_metrics
    from storage.layout import RunLayout

    return read_metrics(RunLayout(str(tmp_path / "runs"), name))


def test_a_stage_stuck_in_python_is_failed_at_its_deadline_and_retried(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    clean = _train(_config_file(tmp_path, "clean", tiny_model_dir, digits_dataset_dir), fresh=True)
    assert clean.returncode == 0, (clean.stdout + clean.stderr)[-3000:]

    started = time.monotonic()
    stuck = _train(_config_file(tmp_path, "stuck", tiny_model_dir, digits_dataset_dir), HANG_AT, "python")
    assert stuck.returncode == 0, (stuck.stdout + stuck.stderr)[-3000:]
    assert time.monotonic() - started < UPDATE_DEADLINE_S + 240
    # The terminal stays quiet about a retried stage; the run's log has the failed attempt, named.
    log = "".join(p.read_text() for p in (tmp_path / "runs" / "stuck" / "logs").glob("*.log"))
    assert "Task run 'update-iter-2' - Task run failed with exception: StageDeadlineExceeded" in log, log[-3000:]
    assert f"stage update of iteration 2 ran past its deadline of {UPDATE_DEADLINE_S} s" in log
    assert f"pipeline.deadlines.stages.update = {UPDATE_DEADLINE_S} s" in log

    # The retried iteration is the one an uninterrupted run trains (same samples, same update).
    rows, expected = _rows(tmp_path, "stuck"), _rows(tmp_path, "clean")
    assert [r["iteration"] for r in rows] == [1, 2]
    for row, want in zip(rows, expected):
        assert {k: row[k] for k in COMPARED} == {k: want[k] for k in COMPARED}


def test_a_stage_blocked_in_native_code_ends_the_process_by_name_and_the_run_resumes(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from tasks.deadlines import EXIT_DEADLINE

    config = _config_file(tmp_path, "blocked", tiny_model_dir, digits_dataset_dir, grace_s=5)
    blocked = _train(config, HANG_AT, "native")
    assert blocked.returncode == EXIT_DEADLINE, (blocked.stdout + blocked.stderr)[-3000:]
    # One line on the terminal (the captured stdout: `ppoflow train` shows the user its display there)
    named = [line for line in blocked.stdout.splitlines() if "ran past its deadline" in line]
    assert len(named) == 1, (blocked.stdout + blocked.stderr)[-3000:]
    assert named[0].startswith("ppoflow: error: StageDeadlineExceeded: ")
    assert "stage update of iteration 2" in named[0] and "grace_s = 5 s" in named[0]
    assert [r["iteration"] for r in _rows(tmp_path, "blocked")] == [1]  # iteration 1 committed, kept

    resumed = _train(config)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert [r["iteration"] for r in _rows(tmp_path, "blocked")] == [1, 2]


def test_a_stage_on_a_pool_without_workers_fails_naming_the_pool(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.stage_flows import rollout_stage
    from flows.training import ppo_training

    pool = "nobody-home"
    create_process_pools([pool], prefect_api)  # a rerun on a kept server: it exists already
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name(rollout_stage.name)
        client.create_deployment(
            flow_id=flow_id, name="unserved", work_pool_name=pool, entrypoint="flows/stage_flows.py:rollout_stage"
        )
    cfg = small_config(
        str(tmp_path / "runs"),
        "unserved",
        tiny_model_dir,
        digits_dataset_dir,
        iterations=1,
        pipeline={"stage_pools": {"rollout": f"{rollout_stage.name}/unserved"}, "deadlines": {"pickup_s": 5}},
    )
    started = time.monotonic()
    state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
    assert time.monotonic() - started < 120
    assert state.is_failed(), state
    with pytest.raises(Exception, match=rf"stage rollout of iteration 1 was not taken by work pool '{pool}'") as err:
        state.result()
    assert f"`prefect worker start --pool {pool}`" in str(err.value)
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["rollout-iter-1"])))
    ours = [r for r in runs if r.deployment_id and r.state and r.state.is_cancelled()]
    assert ours, [(r.name, r.state) for r in runs]
