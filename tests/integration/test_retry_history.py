"""What Prefect shows after a Retry: each iteration once, under its own name, with its own task runs.

Prefect matches a flow's subflow and task calls to the previous attempt's by call order (a per-flow-run counter).
A Retry starts at the first uncommitted iteration, so before the fix the retry's first iteration was attached to
the first attempt's iteration 1 (renamed, its task runs mixed with the new ones, or skipped as already done).
Here a run fails at iteration 3 of 4, is retried the way the UI does it (AwaitingRetry, then the same flow run
again), and Prefect's API is read back: the completed subflow runs are iterations 1..4, once each, named after
their run and iteration, each holding exactly its own stage task runs; the failed attempt of iteration 3 stays
as it was (Failed, before the retry); and the training run's own state names the failing stage and its error.
"""

from __future__ import annotations

import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

STAGES = ("rollout", "score", "update", "checkpoint")


def _task_runs(client, flow_run_ids):
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    return client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=flow_run_ids)))


def _iteration_runs(client, flow_run_id):
    """(subflow run, its task runs) for every iteration run under the training run, found through the training
    run's task runs (the server is shared with other tests): the subflow tracking task runs, or with pipelined
    iterations the slot task runs the subflows run in."""
    from prefect.client.schemas.filters import FlowRunFilter

    own_tasks = _task_runs(client, [flow_run_id])
    children = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_task_run_id={"any_": [t.id for t in own_tasks]}), limit=200
    )
    return [(child, _task_runs(client, [child.id])) for child in children]


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sequential", "pipelined"])
def test_a_retried_run_shows_each_iteration_once_under_its_own_name(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch, max_staleness
):
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import AwaitingRetry

    from engines import warm
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for
    from tests.fixtures.faults import fail_when

    run = f"history-k{max_staleness}"
    cfg = small_config(
        str(tmp_path / "runs"),
        run,
        tiny_model_dir,
        digits_dataset_dir,
        iterations=4,
        pipeline={"max_staleness": max_staleness, "retries": 0},
    )
    params = {"config": cfg.model_dump(mode="json")}
    with monkeypatch.context() as faults:
        fail_when(
            faults,
            "stages.update",
            "run_update",
            lambda cfg, iteration, *args, **kwargs: iteration == 3,
        )
        state = ppo_training(**params, return_state=True)
    assert state.is_failed(), state
    flow_run_id = state.state_details.flow_run_id
    assert [r["iteration"] for r in read_metrics(layout_for(cfg))] == [1, 2]

    with get_client(sync_client=True) as client:
        failed = client.read_flow_run(flow_run_id)
        # The training run's own page says which stage of which iteration failed, and why.
        assert "update" in failed.state.message and "iteration 3" in failed.state.message, failed.state.message
        assert "injected fault" in failed.state.message, failed.state.message
        retry_started = client.set_flow_run_state(flow_run_id, AwaitingRetry(), force=True).state.timestamp
        flow_run = client.read_flow_run(flow_run_id)

    warm.invalidate()  # a fresh worker process would hold no engines either
    final = run_flow(flow=ppo_training, flow_run=flow_run, parameters=params, return_type="state")
    assert final.is_completed(), final
    assert [r["iteration"] for r in read_metrics(layout_for(cfg))] == [1, 2, 3, 4]

    with get_client(sync_client=True) as client:
        iterations = _iteration_runs(client, flow_run_id)
    completed = sorted((sub.name, sub, tasks) for sub, tasks in iterations if sub.state.is_completed())
    assert [name for name, _, _ in completed] == [f"{run}/iter-{i:04d}" for i in (1, 2, 3, 4)], [
        (sub.name, sub.state.type.value) for sub, _ in iterations
    ]
    for i, (name, sub, tasks) in enumerate(completed, start=1):
        assert sub.parameters["iteration"] == i, (name, sub.parameters["iteration"])
        stage_runs = sorted(t.name for t in tasks if t.name.split("-iter-")[0] in STAGES)
        # its own four stage runs, no other iteration's (the bug listed two iterations' task runs under one)
        assert stage_runs == sorted(f"{stage}-iter-{i}" for stage in STAGES), (name, stage_runs)
        began_after_retry = sub.start_time is not None and sub.start_time >= retry_started
        assert began_after_retry == (i >= 3), (name, sub.start_time, retry_started)  # 1, 2: the first attempt's
    # the failed attempts, kept as history: iteration 3, and with k = 1 iteration 4, which failed waiting for it
    others = sorted((sub.name, sub.state.type.value) for sub, _ in iterations if not sub.state.is_completed())
    failed_first = (3,) if max_staleness == 0 else (3, 4)
    assert others == [(f"{run}/iter-{i:04d}", "FAILED") for i in failed_first], others
