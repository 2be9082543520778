"""The bare engine loop hands the actor's weights to an in-process HF engine in memory (no folder written),
and the engine registry then stops claiming the engine serves the folder it was built from."""

from __future__ import annotations

import torch

from engines.models import load_policy
from engines.rollout.registry import get_rollout_engine
from stages.loop import EngineLoop
from tests.integration.pipeline_helpers import small_config


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_engine_loop_syncs_the_actor_in_memory(tmp_path, tiny_model_dir, digits_dataset_dir):
    cfg = small_config(str(tmp_path / "runs"), "loop-sync", tiny_model_dir, digits_dataset_dir)
    loop = EngineLoop(cfg, work_dir=str(tmp_path / "loop"))
    try:
        loop.run_iteration(1)
        actor = loop.trainer.actor.module.state_dict()
        initial = load_policy(tiny_model_dir).state_dict()
        assert not _equal(actor, initial)  # the update moved the actor, so the next check means something
        assert _equal(loop.engine.model.state_dict(), actor)
        assert loop.engine.policy_version == 1
        assert not (tmp_path / "loop" / "policy").exists()  # the sync wrote nothing
        # Asking the registry for the initial folder must load it again, not hand out the updated weights.
        engine = get_rollout_engine(cfg.rollout, cfg.model, str(tiny_model_dir), 0, cfg.run.seed)
        assert engine is loop.engine and engine.policy_version == 0
        assert _equal(engine.model.state_dict(), initial)
        # save_policy writes the actor as a folder from_pretrained loads.
        assert _equal(load_policy(loop.save_policy()).state_dict(), actor)
    finally:
        loop.shutdown()
    assert (tmp_path / "loop" / "policy" / "config.json").exists()  # the caller's folder outlives the loop


def test_engine_loop_removes_the_temp_folder_it_made(tmp_path, tiny_model_dir, digits_dataset_dir):
    cfg = small_config(str(tmp_path / "runs"), "loop-temp", tiny_model_dir, digits_dataset_dir)
    loop = EngineLoop(cfg)
    try:
        saved = loop.save_policy()
        assert saved.parent == loop.work_dir and (saved / "config.json").exists()
    finally:
        loop.shutdown()
    assert not loop.work_dir.exists()
