"""Multi-turn rollouts on a warm stage worker (`ppoflow worker --stage rollout`, a long-lived process on the
loopback Prefect server): the environment is loaded and its instances built in the worker; the rollout engine is
built once and kept; the rows equal an in-process run's (where a rollout runs changes no conversation).
"""

from __future__ import annotations

import socket

import pytest

from bench.processes import stop_workers
from tests.integration.pipeline_helpers import small_config
from tests.integration.test_multi_turn_pipeline import MULTI_TURN
from tests.integration.test_stage_workers import _manifests, _start_worker

pytestmark = pytest.mark.slow
ITERATIONS = 2


def test_multi_turn_rollout_on_a_warm_worker_equals_in_process(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from engines import warm
    from flows.training import ppo_training
    from storage.layout import layout_for
    from storage.shards import read_shards

    def config(name, **pipeline):
        sections = {**MULTI_TURN, "pipeline": {"retries": 0, "retry_delay_s": 0, **pipeline}}
        return small_config(str(tmp_path / "runs"), name, tiny_model_dir, digits_dataset_dir, ITERATIONS, **sections)

    worker = _start_worker(tmp_path, "rollout", ["rollout"])
    try:
        on_worker = config("mt-warm", stage_workers=["rollout"])
        state = ppo_training(config=on_worker.model_dump(mode="json"), return_state=True)
        assert state.is_completed(), f"{state}\n{(tmp_path / 'rollout.log').read_text()[-3000:]}"
    finally:
        stop_workers([worker])
    layout = layout_for(on_worker)
    manifests = _manifests(layout, "rollout", ITERATIONS)
    assert {m.worker for m in manifests} == {f"{socket.gethostname()}:{worker.pid}"}
    assert [m.engine_builds for m in manifests] == [manifests[0].engine_builds] * ITERATIONS  # kept warm

    in_process = config("mt-in-process")
    warm.invalidate()
    assert ppo_training(config=in_process.model_dump(mode="json"), return_state=True).is_completed()
    columns = ["prompt_ids", "response_ids", "token_owner", "turn_starts", "env_reward", "truncation"]
    for iteration in range(1, ITERATIONS + 1):
        got, want = (
            read_shards(lay.fs, lay.stage_dir(iteration, "rollout"), columns=columns)
            for lay in (layout, layout_for(in_process))
        )
        assert got.equals(want), iteration
        assert any(0 in owners for owners in got.column("token_owner").to_pylist())
