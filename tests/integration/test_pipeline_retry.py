"""A fault in the update stage, then a Retry of the same flow run the way the UI does it.

Retry = set the failed flow run to AwaitingRetry and run it again with its id and parameters (what the
UI's Retry and `prefect flow-run retry` do). Committed iterations are skipped via LATEST; inside the
failed iteration, rollout and score come back from cache (their bodies, and so their engines, do not run
again); the final state equals a run that never failed, and so do its eval rows (eval after every checkpoint).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow


def _final_policy(root, run, iteration):
    return load_file(f"{root}/{run}/checkpoints/iter-{iteration:06d}/policy/model.safetensors")


def test_retry_resumes_from_cache_and_matches_uninterrupted(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import AwaitingRetry

    from engines import warm
    from engines.toy.task import build_digits_dataset
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for
    from storage.shards import read_shards
    from tests.fixtures.faults import count_stage_bodies, fail_when

    root = str(tmp_path / "runs")
    # an eval after every checkpoint: the retried run's eval rows must equal the clean run's too
    held_out = {"data_path": str(build_digits_dataset(tmp_path / "held-out", num_rows=4, seed=5)), "every": 1}
    faulty = small_config(root, "faulty", tiny_model_dir, digits_dataset_dir, iterations=2, eval=held_out)
    params = {"config": faulty.model_dump(mode="json")}

    # The worst moment: after iteration 2's PPO step, before its experience shards and checkpoint are written.
    with monkeypatch.context() as faults:
        fail_when(
            faults,
            "stages.update",
            "write_stage_table",
            lambda cfg, layout, iteration, *args, **kwargs: iteration == 2,
        )
        state = ppo_training(**params, return_state=True)
    assert state.is_failed(), state
    assert "injected fault" in str(state.message) or "injected fault" in repr(state)
    flow_run_id = state.state_details.flow_run_id
    # Iteration 1 committed; iteration 2's update never staged a checkpoint.
    layout = layout_for(faulty)
    assert [r["iteration"] for r in read_metrics(layout)] == [1]

    warm.invalidate()  # a fresh worker process would hold no engines either
    calls = count_stage_bodies(monkeypatch)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, AwaitingRetry(), force=True)
        flow_run = client.read_flow_run(flow_run_id)
    final = run_flow(flow=ppo_training, flow_run=flow_run, parameters=params, return_type="state")
    assert final.is_completed(), final
    assert calls["rollout"] == 0 and calls["score"] == 0, calls  # came back from cache
    assert calls["update"] == 1 and calls["checkpoint"] == 1, calls
    assert calls["eval"] == 1, calls  # iteration 2's (iteration 1's committed before the fault)

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).state.is_completed()

    # The same run that never failed.
    clean = small_config(root, "clean", tiny_model_dir, digits_dataset_dir, iterations=2, eval=held_out)
    warm.invalidate()
    assert ppo_training(config=clean.model_dump(mode="json"), return_state=True).is_completed()
    got, want = _final_policy(root, "faulty", 2), _final_policy(root, "clean", 2)
    assert got.keys() == want.keys()
    for name in want:
        # Same seeds, same data, same ops on one CPU rank: the update is deterministic, so equality is exact
        # up to float reassociation in a rebuilt optimizer (none expected); 1e-6 leaves room for that only.
        assert (got[name] - want[name]).abs().max().item() <= 1e-6, name
    faulty_rows = read_metrics(layout)
    clean_rows = read_metrics(layout_for(clean))
    assert [r["reward/mean"] for r in faulty_rows] == pytest.approx([r["reward/mean"] for r in clean_rows], abs=1e-6)
    assert [r["eval/reward_mean"] for r in faulty_rows] == [r["eval/reward_mean"] for r in clean_rows]
    for iteration in (1, 2):  # the same samples, not only the same mean
        got, want = (
            read_shards(lay.fs, lay.stage_dir(iteration, "eval"), columns=["response_ids", "reward"])
            for lay in (layout, layout_for(clean))
        )
        assert got.equals(want), iteration
