"""Multi-turn through the whole pipeline (ppo_training, Prefect on loopback, HF generate, DeepSpeed on CPU, PPO
with a critic): the scripted DigitGuessEnv of tests/fixtures/digit_env.py, its reward summed with the digits
function by weight.

What holds for single-turn holds here (issue 39 item 7): a fault in iteration 2's update, then a Retry of the same
flow run as the UI does it: rollout and score come back from Prefect's cache (their bodies do not run again) and
the final policy equals a run that never failed. And in the shards: the rollout's token_owner, the scored reward
= env_reward + 0.5 * digit share, the experience's advantages and returns 0 on the environment's tokens.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

MULTI_TURN = {
    "model": {"apply_chat_template": True},
    "data": {"data_source_key": None, "max_prompt_tokens": 16},
    "rollout": {
        "engine": "hf",
        "prompts_per_iteration": 4,
        "n_samples": 2,
        "max_new_tokens": 4,
        "environment": {"source": "tests.fixtures.digit_env:DigitGuessEnv", "max_turns": 3, "max_total_tokens": 48},
    },
    "reward": {
        "sources": [
            {"kind": "environment"},
            {"kind": "function", "target": "engines.toy.task:reward_func", "weight": 0.5},
        ]
    },
}


def _config(root, name, model_dir, data_dir):
    return small_config(root, name, model_dir, data_dir, iterations=2, **MULTI_TURN)


def test_multi_turn_run_retries_from_cache_and_trains_on_policy_tokens_only(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import AwaitingRetry

    from engines import warm
    from engines.toy.task import digit_reward
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for
    from storage.shards import read_shards
    from tests.fixtures.faults import count_stage_bodies, fail_when

    root = str(tmp_path / "runs")
    faulty = _config(root, "mt-faulty", tiny_model_dir, digits_dataset_dir)
    params = {"config": faulty.model_dump(mode="json")}
    with monkeypatch.context() as faults:
        fail_when(faults, "stages.update", "write_stage_table", lambda cfg, lay, it, *a, **k: it == 2)
        state = ppo_training(**params, return_state=True)
    assert state.is_failed(), state
    layout = layout_for(faulty)
    assert [r["iteration"] for r in read_metrics(layout)] == [1]

    warm.invalidate()
    calls = count_stage_bodies(monkeypatch)
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, AwaitingRetry(), force=True)
        flow_run = client.read_flow_run(flow_run_id)
    final = run_flow(flow=ppo_training, flow_run=flow_run, parameters=params, return_type="state")
    assert final.is_completed(), final
    assert calls["rollout"] == 0 and calls["score"] == 0 and calls["update"] == 1, calls

    clean = _config(root, "mt-clean", tiny_model_dir, digits_dataset_dir)
    warm.invalidate()
    assert ppo_training(config=clean.model_dump(mode="json"), return_state=True).is_completed()
    got = load_file(f"{root}/mt-faulty/checkpoints/iter-000002/policy/model.safetensors")
    want = load_file(f"{root}/mt-clean/checkpoints/iter-000002/policy/model.safetensors")
    for name in want:
        assert (got[name] - want[name]).abs().max().item() <= 1e-6, name

    for iteration in (1, 2):
        rows = read_shards(layout.fs, layout.stage_dir(iteration, "experience")).to_pylist()
        assert any(0 in r["token_owner"] for r in rows), "some conversation should have an observation"
        for r in rows:
            assert len(r["token_owner"]) == len(r["response_ids"]) == len(r["advantages"]) == len(r["returns"])
            for owner, a, ret in zip(r["token_owner"], r["advantages"], r["returns"]):
                if owner == 0:
                    assert a == 0.0 and ret == 0.0
            components = json.loads(r["reward_components"])
            assert components["environment"] == pytest.approx(r["env_reward"])
            expected = r["env_reward"] + 0.5 * digit_reward(r["response"], r["label"])
            assert r["reward"] == pytest.approx(expected, abs=1e-6)
            assert (r["finish_reason"] == "length") == (r["truncation"] is not None)
    metrics = read_metrics(layout)
    assert all(0 < m["response/policy_tokens_mean"] < m["response/length_mean"] for m in metrics)
    # the trainer's log-probs of the policy's tokens (conditioned on the environment's) = the sampler's, as
    # for single-turn rows (each iteration samples with the weights it then trains: max_staleness 0)
    assert all(m["rollout/logprob_abs_diff"] < 1e-5 for m in metrics), [m["rollout/logprob_abs_diff"] for m in metrics]


def test_multi_turn_on_s3_pipelined_in_parts(prefect_api, s3_bucket, tiny_model_dir, digits_dataset_dir):
    """Shards on S3 (moto on loopback), pipeline.max_staleness = 1 (iteration i samples with the policy of i-2,
    decoupled-PPO weights on the policy tokens), the rollout in 2 parts merged: multi-turn rows go through all of
    it, and a person reads token_owner from S3 with s3fs + pyarrow."""
    import pyarrow as pa
    import s3fs

    from engines import warm
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for

    bucket, storage_cfg = s3_bucket
    sections = {**MULTI_TURN, "pipeline": {"max_staleness": 1, "rollout_parts": 2, "retries": 0, "retry_delay_s": 0}}
    cfg = small_config(
        f"s3://{bucket}/runs",
        "mt-s3",
        tiny_model_dir,
        digits_dataset_dir,
        iterations=3,
        storage={"endpoint_url": storage_cfg.endpoint_url},
        **sections,
    )
    warm.invalidate()
    assert ppo_training(config=cfg.model_dump(mode="json"), return_state=True).is_completed()
    rows = read_metrics(layout_for(cfg))
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    assert all(0 < r["async/is_weight_mean"] <= 2.0 for r in rows)

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": storage_cfg.endpoint_url}, skip_instance_cache=True)
    parts = sorted(fs.glob(f"{bucket}/runs/mt-s3/iter-000003/rollout/part-*.arrow"))
    assert parts
    with fs.open(parts[0], "rb") as f:
        table = pa.ipc.open_file(f).read_all()
    assert table.schema.metadata[b"ppoflow.schema_version"] == b"2"
    assert table.column("policy_version").to_pylist() == [1] * table.num_rows  # sampled by the policy of i-1-k
    assert table.num_rows == 8 and any(0 in owners for owners in table.column("token_owner").to_pylist())
