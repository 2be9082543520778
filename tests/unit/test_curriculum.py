"""engines/curriculum.py: a level's task config from reasoning-gym's own curriculum, the promotion rule, the state's
JSON; engines/reasoning_tasks.materialize with a curriculum; the curriculum_level column's schema version."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

pytest.importorskip("reasoning_gym")

from engines.curriculum import CurriculumState, advance, level_count, level_spec, level_task_config  # noqa: E402
from engines.reasoning_tasks import materialize  # noqa: E402
from ppoflow.config import ConfigError, CurriculumConfig, ReasoningGymConfig, load_config  # noqa: E402
from stages.curriculum_state import tag_level  # noqa: E402
from storage.schema import CURRICULUM_VERSION, validate, version_of  # noqa: E402

BASE = {"operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}


def _spec(**curriculum) -> ReasoningGymConfig:
    data = {"task": "basic_arithmetic", "config": BASE, "size": 50, "eval_size": 10}
    return ReasoningGymConfig(**data, curriculum={"target_level": 2, **curriculum})


class TestLevels:
    def test_global_level_follows_reasoning_gyms_curriculum(self):
        # BasicArithmeticCurriculum: num_terms levels [2, 3, 4, 5, 6], num_digits [1, 2, 3, 4]. Global level 2 sets
        # both attributes to index 2 -> 4 terms, 3 digits; upper_bound mode gives exactly those values.
        spec = _spec()
        assert level_count(spec) == 5  # the longest attribute (num_terms) has 5 levels
        got = level_task_config(spec, 2)
        assert (got["min_terms"], got["max_terms"], got["min_digits"], got["max_digits"]) == (4, 4, 3, 3)
        assert got["operators"] == ["+", "-"] and got["allow_negation"] is False  # data.reasoning_gym.config kept
        # level 4: num_digits has only 4 levels, so min(4, 3) = index 3 -> 4 digits; num_terms index 4 -> 6 terms
        top = level_task_config(spec, 4)
        assert (top["max_terms"], top["max_digits"]) == (6, 4)

    def test_explicit_levels_and_inclusive_ranges(self):
        levels = [{"num_terms": 0, "num_digits": 0}, {"num_terms": 1, "num_digits": 0}, {"num_terms": 1}]
        spec = _spec(levels=levels, range_mode="inclusive")
        assert level_count(spec) == 3
        one = level_task_config(spec, 1)
        # inclusive: from the first level's value (2 terms) up to this one's (3 terms); digits stay at level 0 (1)
        assert (one["min_terms"], one["max_terms"], one["min_digits"], one["max_digits"]) == (2, 3, 1, 1)
        plain = level_spec(spec, 1)
        assert plain.curriculum is None and plain.eval_size == 0 and plain.config == one

    def test_bad_levels_are_named(self):
        with pytest.raises(ConfigError, match=r"levels\[0\]: 'terms' is not an attribute"):
            level_task_config(_spec(levels=[{"terms": 1}, {}, {}]), 0)
        with pytest.raises(ConfigError, match=r"levels\[1\].num_digits = 9: its levels are 0..3"):
            level_task_config(_spec(levels=[{}, {"num_digits": 9}, {}]), 1)
        with pytest.raises(ValueError, match="target_level=2 has no entry in levels"):
            CurriculumConfig(target_level=2, levels=[{}, {}])
        with pytest.raises(ValueError, match="start_level=3 is above the top level 2"):
            CurriculumConfig(target_level=2, start_level=3)

    def test_a_task_without_a_curriculum_is_refused_by_name(self):
        spec = ReasoningGymConfig(task="gsm_symbolic", curriculum={"target_level": 1})  # none in 0.1.25
        with pytest.raises(ConfigError, match="has no reasoning-gym curriculum"):
            level_task_config(spec, 0)


class TestPromotion:
    plan = CurriculumConfig(target_level=2, promote_at=0.5, promote_after=2)

    def test_two_in_a_row_promote_and_a_miss_resets(self):
        # rewards at level 0: 0.6 (streak 1), 0.4 (reset 0), 0.5 (1: >= is enough), 0.7 (2 -> level 1, streak 0)
        state, moves = CurriculumState(0, 0), []
        for reward in (0.6, 0.4, 0.5, 0.7):
            state, promoted = advance(self.plan, state, reward)
            moves.append((state.level, state.streak, promoted))
        assert moves == [(0, 1, False), (0, 0, False), (0, 1, False), (1, 0, True)]

    def test_never_past_the_top_never_down_and_none_measures_nothing(self):
        state = CurriculumState(2, 0)
        for reward in (0.9, 0.9, 0.9):
            state, promoted = advance(self.plan, state, reward)
            assert state.level == 2 and not promoted
        low, _ = advance(self.plan, state, 0.0)
        assert low == CurriculumState(2, 0)  # a low reward resets the streak, never the level
        assert advance(self.plan, CurriculumState(1, 1), None) == (CurriculumState(1, 1), False)

    def test_state_json_round_trip_and_damage(self):
        assert CurriculumState.from_json(CurriculumState(3, 1).to_json(), "x") == CurriculumState(3, 1)
        with pytest.raises(ValueError, match="ckpt/curriculum.json: not a curriculum state"):
            CurriculumState.from_json({"level": -1, "streak": 0}, "ckpt/curriculum.json")


def test_materialize_writes_every_level_and_the_target_eval(tmp_path):
    cfg = load_config(
        None,
        [
            f"run.root={tmp_path}",
            "data.reasoning_gym.task=basic_arithmetic",
            f"data.reasoning_gym.config={json.dumps(BASE)}",
            "data.reasoning_gym.size=40",
            "data.reasoning_gym.eval_size=10",
            'data.reasoning_gym.curriculum={"start_level": 1, "target_level": 2}',
        ],
    )
    done = materialize(cfg)
    start_rows = [json.loads(line) for line in open(done.data.path)]
    held = [json.loads(line) for line in open(done.eval.data_path)]
    # level 1 = 3 terms (two operators); level 2 = 4 terms (three): count the operators of each question
    ops = lambda row: sum(json.loads(row["label"])["question"].count(o) for o in (" + ", " - "))  # noqa: E731
    assert len(start_rows) == 40 and {ops(r) for r in start_rows} == {2}
    assert len(held) == 10 and {ops(r) for r in held} == {3}
    level_2_train = {r["prompt"] for r in map(json.loads, open(tmp_path / _level_file(tmp_path, done, 2)))}
    assert not level_2_train & {r["prompt"] for r in held}  # held-out rows are not among the target level's


def _level_file(tmp_path, cfg, level):
    from engines.reasoning_tasks import level_train_path

    return level_train_path(cfg, level).relative_to(tmp_path)


def test_curriculum_rows_are_schema_version_3():
    from storage.schema import schema_for

    rows = schema_for("rollout").empty_table()
    tagged = tag_level(rows, 1)
    assert tag_level(rows, None) is rows and version_of(rows) == 1
    assert version_of(tagged) == CURRICULUM_VERSION == 3
    assert validate(tagged, "rollout").schema.field("curriculum_level").type == pa.int32()
