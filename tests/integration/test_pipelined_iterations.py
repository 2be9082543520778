"""Pipelined iterations in one process (pipeline.max_staleness = k): the fixed schedule, the overlap, exact resume.

Expected values come from the schedule's definition, not from the code's output: iteration i samples with the
policy committed at i-1-k (version max(0, i-1-k)) and trains the one committed at i-1, so its staleness is
min(k, i-1); iteration i+1's rollout starts before iteration i's update ends (seen in Prefect's task runs).
"""

from __future__ import annotations

import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
ITERATIONS = 4
UPDATE_DELAY_S = 3.0


def _run(cfg):
    from flows.training import ppo_training

    state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
    assert state.is_completed(), state
    return state


def _task_runs(flow_run_name: str):
    """{task run name: (start, end)} of every stage task run under the training flow run named so."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name]))
            )
            (parent,) = runs
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [parent.id]})
            )
            out = {}
            for child in children:
                for tr in await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [child.id]})):
                    out[tr.name] = (tr.start_time, tr.end_time)
            return out

    return asyncio.run(read())


def test_k1_follows_the_fixed_schedule_overlaps_stages_and_corrects_stale_rows(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    from flows.records import read_metrics
    from stages.manifests import RolloutManifest
    from storage.layout import layout_for
    from storage.stage_records import read_stage_record
    from tests.fixtures.faults import slow_down

    # The tiny update takes ~0.1 s, less than Prefect takes to begin the next slot's subflow, so without this the
    # overlap below would be a race. Slowed by UPDATE_DELAY_S, a pipelined run must start rollout i+1 inside
    # update i; a sequential one cannot (its rollout i+1 waits for checkpoint i).
    slow_down(monkeypatch, "stages.update", "run_update", UPDATE_DELAY_S)

    k = 1
    cfg = small_config(
        str(tmp_path / "runs"),
        "k1",
        tiny_model_dir,
        digits_dataset_dir,
        iterations=ITERATIONS,
        pipeline={"max_staleness": k},
        run={"keep_checkpoints": 1},
    )
    _run(cfg)
    layout = layout_for(cfg)
    rows = read_metrics(layout)
    assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
    for row in rows:
        i = row["iteration"]
        assert row["async/staleness"] == min(k, i - 1), row  # the property: never more than k
        rollout = RolloutManifest.model_validate(read_stage_record(layout, i, "rollout"))
        assert rollout.policy_version == max(0, i - 1 - k)
        # The decoupled-PPO weights are applied (and only they: no TIS metric under its other name).
        assert 0 < row["async/is_weight_mean"] <= 2.0 and 0 <= row["async/is_weight_clipfrac"] <= 1
        assert "tis/weight_mean" not in row

    # Retention keeps the newest k+1 checkpoints whatever run.keep_checkpoints says: iteration i+1 samples with
    # the checkpoint of i-k, which must outlive the commit of iteration i.
    assert sorted(p.name for p in (tmp_path / "runs" / "k1" / "checkpoints").glob("iter-*")) == [
        f"iter-{i:06d}" for i in range(ITERATIONS - k, ITERATIONS + 1)
    ]

    # The pipeline overlapped: iteration i+1's rollout started before iteration i's update ended.
    runs = _task_runs(f"ppo-training-{cfg.run.name}")
    overlaps = [runs[f"rollout-iter-{i + 1}"][0] < runs[f"update-iter-{i}"][1] for i in range(2, ITERATIONS)]
    assert all(overlaps), runs
