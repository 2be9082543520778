"""ppo_training for 2 iterations against a real Prefect server and a real S3-protocol server, both on
loopback; then the flow, subflow and task run states and the iterations' artifacts through the Prefect client, and
the shards through s3fs."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
STAGES = ("rollout", "score", "update", "checkpoint")


def test_training_on_prefect_and_s3(prefect_api, s3_bucket, tiny_model_dir, digits_dataset_dir):
    import s3fs
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentTaskRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    from engines import warm
    from flows.training import ppo_training

    bucket, storage_cfg = s3_bucket
    cfg = small_config(
        f"s3://{bucket}/runs",
        "s3run",
        tiny_model_dir,
        digits_dataset_dir,
        iterations=2,
        storage={"endpoint_url": storage_cfg.endpoint_url},
    )
    warm.invalidate()
    state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
    assert state.is_completed(), state
    parent_id = state.state_details.flow_run_id

    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(parent_id)
        assert parent.state.is_completed() and parent.name == "ppo-training-s3run"
        # Subflows are linked to the parent through a task run of the parent's (the server is shared with
        # other tests, whose runs have the same names).
        parent_tasks = {
            t.id
            for t in client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[parent_id]))
            )
        }
        # filtered by the server: a page of all runs can miss some once the shared server holds hundreds
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(any_=sorted(parent_tasks)))
        )
        by_name = {r.name: r for r in children}
        assert {"s3run/iter-0001", "s3run/iter-0002"} <= set(by_name), sorted(by_name)
        for i in (1, 2):
            sub = by_name[f"s3run/iter-{i:04d}"]
            assert sub.state.is_completed(), (sub.name, sub.state)
            tasks = client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[sub.id]))
            )
            names = {t.name: t for t in tasks}
            for stage in STAGES:
                task = names[f"{stage}-iter-{i}"]
                assert task.state.is_completed(), (task.name, task.state)
        # one artifact per iteration, on the training run itself (its Artifacts tab, no subflow to open): the
        # iteration's metrics and its shards' S3 URIs, a version of the key `s3run-iteration` each
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[parent_id]))
        )
        texts = sorted(a.data for a in artifacts if a.key == "s3run-iteration")
        assert len(texts) == 2, [a.key for a in artifacts]
        for i, text in zip((1, 2), texts):
            assert f"# s3run, iteration {i}" in text, text
            assert f"`s3://{bucket}/runs/s3run/iter-{i:06d}/rollout` (16 rows)" in text
            assert f"| iteration | {i} |" in text

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": storage_cfg.endpoint_url}, skip_instance_cache=True)
    expected_rows = cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples  # 8 prompts x 2 samples
    for i in (1, 2):
        scored_dir = f"{bucket}/runs/s3run/iter-{i:06d}/scored"
        manifest = json.loads(fs.cat_file(f"{scored_dir}/_manifest.json"))
        tables = []
        for part in manifest["parts"]:
            with fs.open(f"{scored_dir}/{part['name']}", "rb") as f:
                tables.append(pa.ipc.open_file(f).read_all())
        table = pa.concat_tables(tables)
        assert table.num_rows == expected_rows
        assert set(table.column("iteration").to_pylist()) == {i}
        assert all(
            len(r) == len(lp)
            for r, lp in zip(table.column("response_ids").to_pylist(), table.column("ref_logprobs").to_pylist())
        )
        assert set(table.column("policy_version").to_pylist()) == {i - 1}
    latest = json.loads(fs.cat_file(f"{bucket}/runs/s3run/LATEST"))
    assert latest["iteration"] == 2
    assert fs.exists(f"{bucket}/runs/s3run/checkpoints/iter-000002/_COMMITTED")
    assert len(fs.cat_file(f"{bucket}/runs/s3run/metrics.jsonl").decode().strip().splitlines()) == 2
