"""Engines that are replaced (stages/engine_replacement.py): vLLM's EngineCore SIGKILLed in a rollout stage on the
tiny model. Within the stage the engine is built again and the prompts sampled again with their seeds: the stage's
rows equal an uninterrupted rollout's, the manifest counts the replacement. One death more than
rollout.engine_replacements allows fails the stage naming the stage, the iteration and the setting. The EngineCore is
killed before a generate, and in the middle of one (after its first tokens reached the client)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engines.rollout.registry import shutdown_all  # noqa: E402
from stages.engine_replacement import EngineLost  # noqa: E402
from stages.policy import policy_ref  # noqa: E402
from stages.rollout import run_rollout  # noqa: E402
from storage.layout import layout_for  # noqa: E402
from storage.shards import read_shards  # noqa: E402
from tests.fixtures.faults import kill_engine_core_before_generate, kill_engine_core_mid_generate  # noqa: E402
from tests.integration.pipeline_helpers import small_config  # noqa: E402

pytestmark = pytest.mark.slow

VLLM = {"engine": "vllm", "kv_cache_space_gib": 0.25, "max_model_len": 256}
ROWS = ("prompt_ids", "response_ids", "rollout_logprobs", "sample_index")


@pytest.fixture(autouse=True, scope="module")
def _engines_shut_down():
    # Once per module: every test here asks for the same engine (model and settings), so a test after another starts
    # from the engine that test left alive (the replacement it built) instead of building one more. In file order,
    # the death past the budget comes last: it leaves no live engine.
    yield
    shutdown_all()


def _rows(cfg) -> dict:
    layout = layout_for(cfg)
    return read_shards(layout.fs, layout.stage_dir(1, "rollout")).select(list(ROWS)).to_pydict()


def test_a_killed_engine_core_is_replaced_and_the_rows_are_unchanged(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    uninterrupted = small_config(str(tmp_path / "runs"), "whole", tiny_model_dir, digits_dataset_dir, rollout=VLLM)
    run_rollout(uninterrupted, 1, policy_ref(uninterrupted, 1))
    killed = kill_engine_core_before_generate(monkeypatch, kills=1)
    cfg = small_config(str(tmp_path / "runs"), "killed", tiny_model_dir, digits_dataset_dir, rollout=VLLM)
    manifest = run_rollout(cfg, 1, policy_ref(cfg, 1))
    assert len(killed) == 1 and manifest.engine_replacements == 1
    assert manifest.attested is not None and manifest.attested.version == 0  # the new engine was attested too
    assert _rows(cfg) == _rows(uninterrupted)
    # the stage's seconds split (bench.roofline): both engines served, then the one sampling that counted; the stage
    # also wrote its shards, outside both
    serve, sample = manifest.metrics["timing/rollout_serve"], manifest.metrics["timing/rollout_sample"]
    assert serve > 0 and sample > 0 and serve + sample < manifest.seconds


def test_an_engine_core_killed_in_the_middle_of_a_generate_is_replaced_and_the_rows_are_unchanged(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    # 48 new tokens per sample: the generate is still running when its first step's tokens reach the client
    rollout = {**VLLM, "max_new_tokens": 48}
    uninterrupted = small_config(
        str(tmp_path / "runs"), "whole-long", tiny_model_dir, digits_dataset_dir, rollout=rollout
    )
    run_rollout(uninterrupted, 1, policy_ref(uninterrupted, 1))
    killed = kill_engine_core_mid_generate(monkeypatch, kills=1)
    cfg = small_config(str(tmp_path / "runs"), "killed-mid", tiny_model_dir, digits_dataset_dir, rollout=rollout)
    manifest = run_rollout(cfg, 1, policy_ref(cfg, 1))
    assert len(killed) == 1 and killed[0]["unfinished"] > 0  # killed with requests still being sampled
    assert manifest.engine_replacements == 1 and manifest.attested.version == 0
    assert _rows(cfg) == _rows(uninterrupted)
    assert max(len(r) for r in _rows(cfg)["response_ids"]) > 1  # (the samples are more than their first token)


def test_a_death_past_the_budget_fails_the_stage_by_name(tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch):
    killed = kill_engine_core_before_generate(monkeypatch, kills=2)
    cfg = small_config(str(tmp_path / "runs"), "twice", tiny_model_dir, digits_dataset_dir, rollout=VLLM)
    with pytest.raises(
        EngineLost,
        match=r"rollout stage of iteration 1: the vllm engine died .* rollout.engine_replacements=1 allows no more",
    ):
        run_rollout(cfg, 1, policy_ref(cfg, 1))
    assert len(killed) == 2
