"""pipeline.rollout_parts: the settings it refuses (naming the field, the value and what is allowed), how the
prompts are split, and the merge's cache key over its parts."""

import pytest

from ppoflow.config import ConfigError, load_config
from stages.manifests import RolloutPartManifest
from stages.rollout_parts import merge_rollout_parts, split_prompts
from tasks.cache_keys import stage_cache_key

# The default rollout: rollout.prompts_per_iteration 32. Each refusal: the overrides, then what its message names.
REFUSED = [
    (["pipeline.rollout_parts=0"], ["pipeline.rollout_parts", "greater than or equal to 1"]),
    (["pipeline.rollout_parts=33"], ["pipeline.rollout_parts=33", "rollout.prompts_per_iteration=32"]),
    (
        ["pipeline.rollout_parts=2", "rollout.dynamic_sampling.enabled=true"],
        ["pipeline.rollout_parts=2", "rollout.dynamic_sampling.enabled=true", "allowed: pipeline.rollout_parts=1"],
    ),
    (
        ["pipeline.rollout_parts=2", "pipeline.stage_pools={rollout: ppo-rollout/ppo-rollout}"],
        ["pipeline.rollout_parts=2", "pipeline.stage_pools.rollout", "pipeline.stage_workers: [rollout]"],
    ),
]


def _refusal(overrides: list[str]) -> str:
    try:
        load_config(None, overrides)
    except ConfigError as err:
        return str(err)
    raise AssertionError(f"accepted: {overrides}")


def test_refused_settings_name_the_fields_and_what_is_allowed():
    for overrides, named in REFUSED:
        message = _refusal(overrides)
        assert all(name in message for name in named), (overrides, message)


def test_one_part_a_prompt_and_parts_on_workers_are_accepted():
    assert load_config(None, []).pipeline.rollout_parts == 1  # the default: one rollout task run
    assert load_config(None, ["pipeline.rollout_parts=32"]).pipeline.rollout_parts == 32  # one prompt a part
    on_workers = load_config(None, ["pipeline.rollout_parts=4", "pipeline.stage_workers=[rollout]"])
    assert on_workers.pipeline.stage_workers == ["rollout"]
    dynamic = load_config(None, ["pipeline.rollout_parts=1", "rollout.dynamic_sampling.enabled=true"])
    assert dynamic.rollout.dynamic_sampling.enabled


def test_split_prompts_makes_contiguous_parts_that_differ_by_at_most_one():
    records = list(range(10))
    # 10 prompts in 4 parts: 10 = 3 + 3 + 2 + 2 (the first 10 % 4 = 2 parts take one more), in order.
    assert [split_prompts(records, p, 4) for p in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert split_prompts(records, 0, 1) == records
    assert [split_prompts(records, p, 10) for p in range(10)] == [[r] for r in records]
    for part, parts in ((4, 4), (-1, 4), (0, 11)):
        with pytest.raises(ValueError, match=f"rollout part {part} of {parts}"):
            split_prompts(records, part, parts)


def _part(part: int, content_hash: str) -> RolloutPartManifest:
    return RolloutPartManifest(
        iteration=1, seconds=0.0, worker="h:1", engine_builds=0, uri="u", rows=2, content_hash=content_hash,
        part=part, parts=2, prompts=1, policy_version=0, engine="hf",
    )  # fmt: skip


def test_merge_cache_key_follows_the_parts_contents_only():
    cfg = load_config(None, ["pipeline.rollout_parts=2"])
    key = stage_cache_key(cfg, "rollout-merge", 1, {"parts": [_part(0, "a"), _part(1, "b")]})
    # Where a part ran does not matter; what it holds (its shards' content hash) and the order do.
    moved = [_part(0, "a").model_copy(update={"worker": "other:2", "seconds": 9.0}), _part(1, "b")]
    assert stage_cache_key(cfg, "rollout-merge", 1, {"parts": moved}) == key
    assert stage_cache_key(cfg, "rollout-merge", 1, {"parts": [_part(0, "a"), _part(1, "c")]}) != key
    assert stage_cache_key(cfg, "rollout-merge", 1, {"parts": [_part(1, "b"), _part(0, "a")]}) != key
    # pipeline.* is in no stage's key: the rollout of a run split in parts keeps the unsplit rollout's key.
    one = load_config(None, [])
    assert stage_cache_key(one, "rollout", 1, {"policy": "p"}) == stage_cache_key(cfg, "rollout", 1, {"policy": "p"})


def test_merge_refuses_parts_out_of_order_or_of_two_policies_before_reading_any():
    cfg = load_config(None, ["pipeline.rollout_parts=2"])
    with pytest.raises(ValueError, match="manifest 0 is part 1 of 2 of iteration 1; expected part 0 of 2"):
        merge_rollout_parts(cfg, 1, [_part(1, "b"), _part(0, "a")])
    with pytest.raises(ValueError, match="expected part 0 of 2 of iteration 2"):
        merge_rollout_parts(cfg, 2, [_part(0, "a"), _part(1, "b")])
    other_policy = _part(1, "b").model_copy(update={"policy_version": 1})
    with pytest.raises(ValueError, match="part 1 was sampled by policy version 1, part 0 by 0"):
        merge_rollout_parts(cfg, 1, [_part(0, "a"), other_policy])
