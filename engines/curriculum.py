"""A reasoning-gym curriculum as levels a run climbs: the task config of a level, and when to move up.

    level_count(spec) -> int                          levels the task's curriculum defines (0 .. count - 1)
    level_task_config(spec, level) -> dict            the task's config at `level` (what create_dataset takes)
    level_spec(spec, level, eval_size=0) -> spec      a plain ReasoningGymConfig for that level (no curriculum)
    CurriculumState(level, streak)                    what the next iteration needs; JSON in every checkpoint
    advance(curriculum, state, reward) -> (state, promoted)   the promotion rule, pure

reasoning-gym ships a curriculum per task (`reasoning_gym.factory.create_curriculum(task)`, a BaseCurriculum with
attributes such as basic_arithmetic's num_terms [2, 3, 4, 5, 6] and num_digits [1, 2, 3, 4]). ppoflow's level L
is either levels[L] of data.reasoning_gym.curriculum (the attributes' own level indices) or, without `levels`,
reasoning-gym's global level (`set_global_level(L)`: every attribute at min(L, its last level)). The curriculum
turns that into the task's config (`generate_configuration`, range_mode = its RangeAttributeMode); the fields of
data.reasoning_gym.config that no attribute sets (operators, allow_negation, ...) are kept.

The promotion rule (`advance`): the measure is the training reward mean of the iteration's samples at the current
level. The training reward, not a held-out slice: it is measured every iteration at no extra cost (a held-out slice
at each level would cost an eval pass per iteration on a 2-core machine) and, with a 0/1 task scorer, it is the
sampled accuracy at that level. It is noisier than a held-out figure, hence promote_after iterations in a row.
A reward >= promote_at adds one to the streak, a lower one resets it to 0; a streak of promote_after moves the
level up by one (never past the top level) and resets the streak. The level never moves down: a harder level's
falling reward is what the model is learning from.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple, Optional

from ppoflow.config import ConfigError, CurriculumConfig, ReasoningGymConfig


def _curriculum(task: str):
    from reasoning_gym.factory import create_curriculum, has_curriculum

    if not has_curriculum(task):
        raise ConfigError(
            f"data.reasoning_gym.curriculum: task {task!r} has no reasoning-gym curriculum "
            f"(reasoning_gym.factory.CURRICULA has basic_arithmetic, chain_sum, ... )"
        )
    return create_curriculum(task)


def level_count(spec: ReasoningGymConfig) -> int:
    """How many levels the run can use: len(curriculum.levels), else the global levels of the task's curriculum
    (its longest attribute's level count)."""
    if spec.curriculum is not None and spec.curriculum.levels is not None:
        return len(spec.curriculum.levels)
    return max(len(a.levels) for a in _curriculum(spec.task).attributes.values())


def _set_level(curriculum, levels: Optional[list[dict[str, int]]], level: int, where: str) -> None:
    if levels is None:
        curriculum.set_global_level(level)
        return
    for name, attr_level in levels[level].items():
        if name not in curriculum.attributes:
            raise ConfigError(
                f"{where}.levels[{level}]: {name!r} is not an attribute of {curriculum.name} "
                f"(its attributes: {', '.join(curriculum.attributes)})"
            )
        top = len(curriculum.attributes[name].levels) - 1
        if attr_level > top:
            raise ConfigError(f"{where}.levels[{level}].{name} = {attr_level}: its levels are 0..{top}")
        curriculum.set_attr_level(name, attr_level)


def level_task_config(spec: ReasoningGymConfig, level: int) -> dict[str, Any]:
    """The task's config at `level`: data.reasoning_gym.config with the curriculum's attributes set for that level.
    ConfigError naming the field for a task without a curriculum, an unknown attribute or a level out of range."""
    from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext, RangeAttributeMode

    where = "data.reasoning_gym.curriculum"
    plan = spec.curriculum or CurriculumConfig(target_level=level)
    count = level_count(spec)
    if not 0 <= level < count:
        raise ConfigError(f"{where}: level {level} is outside the task's levels 0..{count - 1}")
    curriculum = _curriculum(spec.task)
    _set_level(curriculum, plan.levels, level, where)
    context = DefaultCurriculumContext(mode=RangeAttributeMode(plan.range_mode))
    try:
        generated = curriculum.generate_configuration(dict(spec.config), context=context)
    except TypeError as e:
        raise ConfigError(f"data.reasoning_gym.config = {spec.config!r} for task {spec.task!r}: {e}") from None
    fields = dataclasses.asdict(generated)
    for name in ("seed", "size"):  # ppoflow's own (data.reasoning_gym.seed and size)
        fields.pop(name, None)
    return json.loads(json.dumps(fields))  # tuples as lists: the same JSON, so the same data folder hash


def level_spec(spec: ReasoningGymConfig, level: int, eval_size: int = 0) -> ReasoningGymConfig:
    """`spec` at `level` as a plain spec (no curriculum): its training rows are that level's; eval_size held-out
    rows when asked (only the target level has them: a low level's small question space may hold too few)."""
    update = {"config": level_task_config(spec, level), "curriculum": None, "eval_size": eval_size}
    return spec.model_copy(update=update)


class CurriculumState(NamedTuple):
    """The level the next iteration trains at, and how many iterations in a row met promote_at at it."""

    level: int
    streak: int

    def to_json(self) -> dict[str, int]:
        return {"level": self.level, "streak": self.streak}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "CurriculumState":
        """ValueError naming `where` unless `data` is {"level": int >= 0, "streak": int >= 0}."""
        ok = isinstance(data, dict) and set(data) == {"level", "streak"}
        if not ok or not all(isinstance(data[k], int) and data[k] >= 0 for k in ("level", "streak")):
            raise ValueError(f"{where}: not a curriculum state {{level, streak}} (non-negative ints): {data!r}")
        return cls(data["level"], data["streak"])


def advance(plan: CurriculumConfig, state: CurriculumState, reward: Optional[float]) -> tuple[CurriculumState, bool]:
    """The state after an iteration whose samples at state.level had mean reward `reward` (None: no sample at that
    level, nothing measured: the state is kept), and whether the level moved up (module docstring)."""
    if reward is None:
        return state, False
    streak = state.streak + 1 if reward >= plan.promote_at else 0
    if streak >= plan.promote_after and state.level < plan.top_level:
        return CurriculumState(state.level + 1, 0), True
    return CurriculumState(state.level, streak), False
