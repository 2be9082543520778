"""data: -- the prompts, from a dataset folder or reasoning-gym, with its curriculum."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, field_validator, model_serializer, model_validator

from ppoflow.config.base import _Section


class CurriculumConfig(_Section):
    """data.reasoning_gym.curriculum: climb the task's own reasoning-gym curriculum (engines/curriculum.py)."""

    levels: Optional[list[dict[str, Annotated[int, Field(ge=0)]]]] = Field(
        None,
        description="Level L of the run = levels[L], the curriculum attributes' own level indices ({num_terms: 1, "
        "num_digits: 0} for basic_arithmetic; attributes left out stay at their default level). None = reasoning-gym's "
        "global level: level L sets every attribute to min(L, its last level).",
    )
    start_level: int = Field(0, ge=0, description="The level iteration 1 trains at.")
    target_level: int = Field(
        ge=0,
        description="The level of the held-out set (eval.data_path): fixed, so eval accuracy compares across iterations.",
    )
    max_level: Optional[int] = Field(
        None, ge=0, description="The highest level training climbs to; None = target_level."
    )
    promote_at: float = Field(
        0.5,
        ge=0,
        description="Move up a level when the training reward mean at the current level is >= this for "
        "promote_after iterations in a row (the reward is a measured accuracy for 0/1 task scorers).",
    )
    promote_after: int = Field(2, ge=1, description="Iterations in a row at or above promote_at before moving up.")
    range_mode: Literal["inclusive", "upper_bound"] = Field(
        "upper_bound",
        description="How an attribute's level becomes a range (reasoning-gym's RangeAttributeMode): upper_bound = "
        "exactly that level's value (3 terms), inclusive = the first level's value up to it (2 to 3 terms).",
    )

    @model_validator(mode="after")
    def _levels_in_order(self) -> "CurriculumConfig":
        top = self.max_level if self.max_level is not None else self.target_level
        if self.start_level > top:
            raise ValueError(f"start_level={self.start_level} is above the top level {top} (max_level or target_level)")
        if self.levels is not None:
            for name, level in (
                ("start_level", self.start_level),
                ("target_level", self.target_level),
                ("max_level", top),
            ):
                if level >= len(self.levels):
                    raise ValueError(f"{name}={level} has no entry in levels (levels 0..{len(self.levels) - 1})")
        return self

    @property
    def top_level(self) -> int:
        """The highest level training moves to."""
        return self.max_level if self.max_level is not None else self.target_level


class ReasoningGymConfig(_Section):
    task: str = Field(
        description="A reasoning-gym task name (reasoning_gym.factory.DATASETS), e.g. chain_sum, basic_arithmetic, gsm_symbolic."
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's own config fields (its *Config dataclass), e.g. {min_terms: 2, max_terms: 2}; checked by reasoning-gym.",
    )
    size: int = Field(4000, ge=1, description="Training rows (entries seed .. seed + size - 1 of the task).")
    seed: int = Field(1, ge=0, description="The task's seed: entry i is drawn from Random(seed + i).")
    eval_size: int = Field(
        0,
        ge=0,
        description="Held-out rows for the eval stage (eval.data_path is set to them): drawn from eval_seed on, none whose question is among the training rows; 0 = no held-out set.",
    )
    eval_seed: Optional[int] = Field(
        None, ge=0, description="Seed of the held-out rows; None = seed + size (no shared draws)."
    )
    prompt_template: str = Field(
        "{question}",
        description="The prompt text around the task's question ({question}); the chat template comes after, from model.apply_chat_template.",
    )

    curriculum: Optional[CurriculumConfig] = Field(
        None,
        description="{start_level, target_level, promote_at, promote_after, levels, max_level, range_mode}: train on "
        "the task's reasoning-gym curriculum, moving up a level when the training reward passes promote_at; the "
        "held-out set is at target_level. config holds the task's other fields. None = config as given, no levels.",
    )

    @model_serializer(mode="wrap")
    def _without_unset_curriculum(self, handler):
        # Without a curriculum the spec dumps as before it existed: its data folder's hash and cache keys stay.
        data = handler(self)
        if isinstance(data, dict) and data.get("curriculum", 0) is None:
            del data["curriculum"]
        return data

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, template: str) -> str:
        if "{question}" not in template:
            raise ValueError("must contain {question} (where the task's question goes)")
        try:
            template.format(question="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"is not a format string with only {{question}} in it: {e}") from None
        return template


class DataConfig(_Section):
    path: str = Field(
        "./runs/_data/digits",
        description="A datasets folder (save_to_disk), or a .jsonl/.parquet file; set by ppoflow when data.reasoning_gym is given.",
    )
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: Optional[str] = Field(
        "label", description="Column passed to reward functions as the label / ground truth."
    )
    data_source_key: Optional[str] = Field(
        None, description="Column passed to veRL-style compute_score as data_source."
    )
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts longer than this are an error naming the row.")
    reasoning_gym: Optional[ReasoningGymConfig] = Field(
        None,
        description="Generate the prompts with a reasoning-gym task instead of reading a file: {task, config, size, seed, eval_size, eval_seed, prompt_template}; written once as .jsonl under <root>/_data/reasoning-gym/ (data.path and, with eval_size, eval.data_path point there; columns prompt, label = the task's entry as JSON, data_source = the task). Score with engines.rewards.reasoning_tasks (the task's own score_answer). None = data.path.",
    )
