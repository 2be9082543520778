"""The rollout's failure policy for environments (stages/env_failures.py) on a real multi-turn rollout (HF
generate, tiny model, tests/fixtures/digit_env.py): a group with one failing sample is dropped whole and counted
in the metrics and the shards, and training goes on with the whole groups; past the configured share the rollout
fails naming the environment, the rows and the first error."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from engines.environments.checked import EnvironmentFailed
from stages.policy import policy_ref
from stages.rollout import run_rollout
from stages.score import run_score
from stages.update import run_update
from storage.layout import layout_for
from storage.shards import read_shards
from tests.fixtures.digit_env import FailsForRows
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

ENV = "tests.fixtures.digit_env:FailsForRows"
MULTI_TURN = {
    "model": {"apply_chat_template": True},
    "data": {"data_source_key": None, "max_prompt_tokens": 16},
    "algo": {"name": "grpo"},
    "rollout": {
        "engine": "hf",
        "prompts_per_iteration": 4,
        "n_samples": 2,
        "max_new_tokens": 4,
        "environment": {"source": ENV, "max_turns": 3, "max_total_tokens": 48, "max_failed_group_share": 0.3},
    },
    "reward": {"sources": [{"kind": "environment"}]},
}


def _rows(cfg):
    layout = layout_for(cfg)
    return read_shards(layout.fs, layout.stage_dir(1, "rollout"))


def _group_sizes(cfg) -> Counter:
    return Counter(_rows(cfg).column("prompt_index").to_pylist())


def test_a_group_with_one_failed_environment_is_dropped_whole(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    cfg = small_config(str(tmp_path / "runs"), "env-drop", tiny_model_dir, digits_dataset_dir, **MULTI_TURN)
    policy = policy_ref(cfg, 1)
    monkeypatch.setattr(FailsForRows, "rows", set())
    whole = _group_sizes(cfg) if run_rollout(cfg, 1, policy) else None
    assert sorted(whole.values()) == [2, 2, 2, 2]  # 4 prompts x 2 samples
    broken = sorted(whole)[0]

    monkeypatch.setattr(FailsForRows, "rows", {broken})
    monkeypatch.setattr(FailsForRows, "failed", set())
    rollout = run_rollout(cfg, 1, policy)  # the same iteration again: the same rows and seeds
    # by hand: row `broken`'s sample 0 fails at its first step, its sample 1 plays on; both leave, the 3 other
    # groups stay whole: {the others: 2 each}
    assert FailsForRows.failed == {broken}
    assert _group_sizes(cfg) == Counter({row: 2 for row in whole if row != broken})
    assert rollout.metrics["rollout/env_failed_groups"] == 1 and rollout.metrics["rollout/env_failed_samples"] == 1
    metadata = _rows(cfg).schema.metadata
    accounting = json.loads(metadata[b"ppoflow.env_failures"])
    assert {k: accounting[k] for k in ("groups", "failed_groups", "samples", "failed_samples")} == {
        "groups": 4,
        "failed_groups": 1,
        "samples": 8,
        "failed_samples": 1,
    }
    assert f"(row {broken}, sample 0) turn 1" in accounting["first_error"]
    assert f"sandbox for row {broken} is gone" in accounting["first_error"]
    update = run_update(cfg, 1, policy, run_score(cfg, 1, rollout))  # GRPO on the 3 whole groups
    assert update.metrics["reward/mean"] is not None


def test_more_failed_groups_than_allowed_fail_the_rollout_by_name(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    sections = {**MULTI_TURN, "rollout": {**MULTI_TURN["rollout"]}}
    sections["rollout"]["environment"] = {**MULTI_TURN["rollout"]["environment"], "max_failed_group_share": 0.1}
    cfg = small_config(str(tmp_path / "runs"), "env-fail", tiny_model_dir, digits_dataset_dir, **sections)
    monkeypatch.setattr(FailsForRows, "rows", set())
    rows = sorted(_group_sizes(cfg) if run_rollout(cfg, 1, policy_ref(cfg, 1)) else None)
    monkeypatch.setattr(FailsForRows, "rows", {rows[1]})
    monkeypatch.setattr(FailsForRows, "failed", set())
    with pytest.raises(EnvironmentFailed) as failed:  # 1 group of 4 = 25% > 10%
        run_rollout(cfg, 1, policy_ref(cfg, 1))
    message = str(failed.value)
    assert message.startswith(f"rollout: environment '{ENV}' failed in 1 of 4 groups (25%, over ")
    assert f"dataset rows {rows[1]}; first error: environment '{ENV}' (row {rows[1]}, sample 0) turn 1" in message
