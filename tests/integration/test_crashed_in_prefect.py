"""A `ppoflow train` killed with SIGKILL becomes Crashed in Prefect, and the UI's Retry and `prefect flow-run retry`
resume it (with `ppoflow serve` running, as the README says).

Sequence (run "crashy", 2 iterations, and run "abandoned"):
0. run "abandoned" is killed before iteration 1, and nothing starts it again: Prefect's own zombie detection (the
   automation `ppoflow train` creates, fed by the flow run's heartbeats) sets it Crashed within MISSED_BEATS
   heartbeats (checked at step 3: its heartbeat window runs out while steps 1, 2 and 4 go on);
1. start 1 of crashy is killed in iteration 1's update: its flow run stays Running (nobody told Prefect);
2. start 2 (the same command) marks start 1 Crashed (runtime/stale_runs.py) and is killed before iteration 1;
3. (checked last) "abandoned" is Crashed, by the heartbeat automation;
4. with `ppoflow serve` running, the exact call the UI's Retry button makes (POST set_state AwaitingRetry,
   force false) on start 1: served, it takes over start 2's claim (start 2 marked Crashed), trains both
   iterations and ends Completed;
5. `prefect flow-run retry` (Prefect's CLI, no --entrypoint) on start 2: served, Completed, nothing trained again.
The runs have a deployment (the UI shows Retry only for those).
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

from tests.fixtures import warm_python
from tests.fixtures.warm_python import prefect_cli
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}


def _config_file(tmp_path: Path, name: str, model_dir, data_dir, iterations: int):
    """Run `name`'s small config under tmp_path/runs and the YAML file `ppoflow train` is given: (config, path)."""
    cfg = small_config(str(tmp_path / "runs"), name, model_dir, data_dir, iterations=iterations)
    path = tmp_path / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return cfg, path


def _killed_train(config_path: Path, kill: str) -> subprocess.CompletedProcess:
    return warm_python.run(
        [sys.executable, "-m", "tests.fixtures.kill_cli", kill, "train", str(config_path)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _training_runs(client, name: str) -> list:
    """Flow runs of the run's training flow, oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    # filtered by the server: a page of all runs can miss some once the shared server holds hundreds
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"ppo-training-{name}"])))
    return sorted(runs, key=lambda fr: fr.created)


def _wait_for_state(client, flow_run_id, state: str, timeout_s: float):
    deadline = time.time() + timeout_s
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state.type.value == state or time.time() > deadline:
            return run
        time.sleep(2)


def test_a_killed_run_turns_crashed_and_the_ui_retry_and_cli_retry_resume_it(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.deployment import HEARTBEAT_S, MISSED_BEATS
    from flows.records import read_metrics
    from storage.checkpoints import latest_iteration
    from storage.layout import layout_for
    from tests.integration.test_retry_history import STAGES, _iteration_runs

    cfg, config_path = _config_file(tmp_path, "crashy", tiny_model_dir, digits_dataset_dir, iterations=2)
    layout = layout_for(cfg)
    _, abandoned_path = _config_file(tmp_path, "abandoned", tiny_model_dir, digits_dataset_dir, iterations=1)

    abandoned = _killed_train(abandoned_path, "flows.iteration:ppo_iteration@1")
    assert abandoned.returncode == -signal.SIGKILL, abandoned.stderr[-3000:]
    abandoned_at = time.time()

    first = _killed_train(config_path, "stages.update:train_on@1")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    with get_client(sync_client=True) as client:
        (run_1,) = _training_runs(client, "crashy")
        assert run_1.state.type.value == "RUNNING"  # nobody told Prefect
        assert run_1.deployment_id is not None  # what the UI's Retry button needs

    second = _killed_train(config_path, "flows.iteration:ppo_iteration@1")
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    serve = warm_python.Popen(
        [sys.executable, "-m", "cli", "serve"],
        cwd=REPO,
        env=_env(),
        stdout=open(tmp_path / "serve.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with get_client(sync_client=True) as client:
            run_1, run_2 = _training_runs(client, "crashy")
            assert run_1.state.type.value == "CRASHED" and "died" in run_1.state.message, run_1.state
            subflows = [
                fr
                for fr in client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="crashy/iter-"))
                )
                if fr.parent_task_run_id is not None
                and fr.name.startswith("crashy/iter-")
                and fr.state.type.value == "RUNNING"
            ]
            assert subflows == [], [(fr.name, fr.state) for fr in subflows]  # start 1's iteration subflow too

            assert run_2.state.type.value == "RUNNING"  # until a start takes its claim over (step 4)

            # Step 4: the UI's Retry (prefect-ui-library FlowRunsApi.retryFlowRun), verbatim.
            answer = httpx.post(
                f"{os.environ['PREFECT_API_URL']}/flow_runs/{run_1.id}/set_state",
                json={"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}},
                timeout=30,
            )
            assert answer.status_code in (200, 201) and answer.json()["status"] == "ACCEPT", answer.text
            run_1 = _wait_for_state(client, run_1.id, "COMPLETED", 600)
            assert run_1.state.type.value == "COMPLETED", (run_1.state, (tmp_path / "serve.log").read_text()[-3000:])
            assert latest_iteration(layout) == 2
            assert [row["iteration"] for row in read_metrics(layout)] == [1, 2]
            # What the UI shows of the retried run (issue 34): each iteration once under its own name, with its
            # own stage task runs; the killed attempt of iteration 1 stays Crashed beside its new run.
            runs = _iteration_runs(client, run_1.id)
            completed = sorted(sub.name for sub, _ in runs if sub.state.is_completed())
            assert completed == ["crashy/iter-0001", "crashy/iter-0002"], [
                (r.name, r.state.type.value) for r, _ in runs
            ]
            for sub, tasks in runs:
                stage_runs = sorted(t.name for t in tasks if t.name.split("-iter-")[0] in STAGES)
                i = sub.parameters["iteration"]
                assert sub.name == f"crashy/iter-{i:04d}", (sub.name, i)
                if sub.state.is_completed():
                    assert stage_runs == sorted(f"{stage}-iter-{i}" for stage in STAGES), (sub.name, stage_runs)
            others = sorted((sub.name, sub.state.type.value) for sub, _ in runs if not sub.state.is_completed())
            assert others == [("crashy/iter-0001", "CRASHED")], others
            run_2 = client.read_flow_run(run_2.id)  # the retry took start 2's claim over
            assert run_2.state.type.value == "CRASHED" and "died" in run_2.state.message, run_2.state

        # Step 5: Prefect's CLI retry of a deployment run: no --entrypoint.
        retry = prefect_cli("flow-run", "retry", str(run_2.id), env=_env(), timeout_s=120)
        assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
        with get_client(sync_client=True) as client:
            run_2 = _wait_for_state(client, run_2.id, "COMPLETED", 600)
            assert run_2.state.type.value == "COMPLETED", (run_2.state, (tmp_path / "serve.log").read_text()[-3000:])
        assert [row["iteration"] for row in read_metrics(layout)] == [1, 2]  # nothing trained twice

        # Step 3, last: the heartbeat window of "abandoned" ran out while steps 1, 2, 4 and 5 went on.
        with get_client(sync_client=True) as client:
            (lost,) = _training_runs(client, "abandoned")
            # It beat last at most HEARTBEAT_S before it died; its window is MISSED_BEATS beats; the server evaluates
            # proactive triggers every 5 s: 60 s of slack on a busy CI.
            lost = _wait_for_state(client, lost.id, "CRASHED", HEARTBEAT_S * MISSED_BEATS + 60)
            assert lost.state.type.value == "CRASHED", (lost.state, time.time() - abandoned_at)
            assert "no heartbeat" in lost.state.message, lost.state
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=60)
