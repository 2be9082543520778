"""The reward-model stages' hand-offs (stages/manifests.py: RMPlan, RMCheckpointRef, RMUnitManifest) and their cache
keys (tasks/cache_keys.py), without training: a manifest survives JSON as Prefect's result serializer and a stage
record store it, a committed unit's identity is its files' content, and the keys change exactly when a unit's result
could (its config sections, the pairs' contents, its inputs' identities) and stay put when nothing it reads changed,
which is what lets a retried or resumed run find its finished units."""

import json
import os

import pytest

from ppoflow.config import load_config
from stages.manifests import RMCheckpointRef, RMPlan, RMUnitManifest
from stages.reward_model import commit_unit, start_ref
from storage.layout import layout_for
from tasks.cache_keys import stage_cache_key

PLAN = {
    "train_pairs": 36,
    "eval_pairs": 12,
    "dropped": {"too_long": 2},
    "steps_per_epoch": 4,
    "total_steps": 8,
    "steps_per_unit": 5,
    "units": 2,
    "data_id": "d1",
}


def _unit(content_id: str) -> RMUnitManifest:
    return RMUnitManifest(
        iteration=1,
        seconds=2.5,
        worker="host:1",
        engine_builds=1,
        steps=(0, 5),
        metrics={"rm/loss": 0.69, "rm/step": 5, "rm/eval_pairs": 12, "optim/grad_norm": None},
        checkpoint_uri="/runs/r/checkpoints/iter-000001",
        content_id=content_id,
    )


def test_a_unit_manifest_round_trips_through_json_with_its_types():
    unit = _unit("ckpt-a")
    back = RMUnitManifest.model_validate(json.loads(json.dumps(unit.model_dump(mode="json"))))
    assert back == unit and back.steps == (0, 5)
    # ints stay ints: the metrics row the flow writes from them is the same line on a cache hit as on a first run
    assert type(back.metrics["rm/step"]) is int and type(back.metrics["rm/loss"]) is float
    assert back.identity() == "ckpt-a" and _unit("ckpt-b").identity() == "ckpt-b"
    plan = RMPlan(**PLAN)
    assert RMPlan.model_validate_json(plan.model_dump_json()) == plan and plan.identity() == "d1"


def test_the_plan_cuts_steps_into_units():
    plan = RMPlan(**PLAN)  # 8 steps in units of 5: [0, 5) and [5, 8)
    assert [plan.unit_steps(u) for u in (1, 2)] == [(0, 5), (5, 8)]
    with pytest.raises(ValueError, match="unit 3 is outside 1..2"):
        plan.unit_steps(3)


def _cfg(tmp_path, *overrides: str, run: str = "rm"):
    pairs = tmp_path / "pairs.jsonl"
    if not pairs.exists():
        pairs.write_text('{"prompt": "say 3", "chosen": "3 3", "rejected": "w1 w2"}\n')
    base = [f"run.name={run}", f"run.root={tmp_path / 'runs'}", f"rm_train.data_path={pairs}"]
    return load_config(None, base + [f"model.policy_path={tmp_path / 'no-model'}", *overrides])


def _commit(cfg, unit: int, weights: bytes) -> str:
    local = layout_for(cfg).run_dir + f"-scratch-{unit}"
    os.makedirs(f"{local}/model")
    with open(f"{local}/model/model.safetensors", "wb") as f:
        f.write(weights)
    return commit_unit(cfg, unit, local, {"rm/loss": 0.5, "timing/step": 0.1 * unit})


def test_a_committed_units_identity_is_its_files_content(tmp_path):
    cfg = _cfg(tmp_path)
    first, second = _commit(cfg, 1, b"weights one"), _commit(cfg, 2, b"weights two")
    assert first != second  # another checkpoint, another identity
    assert start_ref(cfg, 2) == RMCheckpointRef(
        unit=1, uri=layout_for(cfg).url(layout_for(cfg).checkpoint_dir(1)), content_id=first
    )
    assert start_ref(cfg, 3).identity() == second  # the id the unit returned is the one its successor starts from
    # the same files committed by another run at another time (another timing/step): the same identity
    assert _commit(_cfg(tmp_path, run="other"), 1, b"weights one") == first


def test_cache_keys_change_with_what_a_result_depends_on_only(tmp_path):
    cfg = _cfg(tmp_path)
    plan, start = RMPlan(**PLAN), RMCheckpointRef(unit=0, uri="/m", content_id="initial-x")

    def keys(c) -> tuple[str, str, str]:
        return (
            stage_cache_key(c, "rm-prepare", 0, {}),
            stage_cache_key(c, "rm-unit", 1, {"plan": plan, "start": start}),
            stage_cache_key(c, "rm-export", 2, {"plan": plan, "final": start}),
        )

    same = keys(cfg)
    assert keys(_cfg(tmp_path)) == same  # a retry or a resume computes the same keys: the finished units are found
    # settings no RM result depends on (how the stages are retried, the PPO stages' sections)
    assert keys(_cfg(tmp_path, "pipeline.retries=5", "rollout.n_samples=2", "algo.kl_coef=0.5")) == same
    for changed in ("rm_train.lr=0.5", "model.gradient_checkpointing=true", "run.seed=9"):
        assert all(a != b for a, b in zip(keys(_cfg(tmp_path, changed)), same)), changed
    prepare, unit, export = keys(_cfg(tmp_path, "train.lr_schedule=cosine"))  # the trainer's, not the pairs'
    assert prepare == same[0] and unit != same[1] and export != same[2]
    # new pairs (the file's content; its path is the same): a new plan. The units then get the new plan's identity.
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "say 4", "chosen": "4 4", "rejected": "w1"}\n' * 2)
    assert keys(cfg)[0] != same[0] and keys(cfg)[1:] == same[1:]
    other_plan = plan.model_copy(update={"data_id": "d2"})
    assert stage_cache_key(cfg, "rm-unit", 1, {"plan": other_plan, "start": start}) != same[1]
    other_start = start.model_copy(update={"content_id": "ckpt-y"})
    assert stage_cache_key(cfg, "rm-unit", 1, {"plan": plan, "start": other_start}) != same[1]
    assert stage_cache_key(cfg, "rm-unit", 2, {"plan": plan, "start": start}) != same[1]  # another unit
