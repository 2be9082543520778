"""What every config section shares: the base model (strict, unknown keys refused, floats written as text
read as numbers) and the names the sections check against."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# The stages an iteration runs, in order; `pipeline.stage_pools` keys must be among them.
PIPELINE_STAGES = ("rollout", "score", "update", "checkpoint", "eval")
MAX_STALENESS = 8  # pipeline.max_staleness: iterations in flight beyond the one updating
# Run names that would put a run where it does not belong: `.` is the root itself (the run would mix with the
# shared score cache under <root>/cache), `..` its parent, `cache` the shared score cache folder.
RESERVED_RUN_NAMES = (".", "..", "cache")


def _takes_float(annotation: Any) -> bool:
    """True for `float` and `Optional[float]` field annotations."""
    union = typing.get_origin(annotation) is typing.Union
    return annotation is float or (union and float in typing.get_args(annotation))


# Fields of ppoflow's own multi-node rank group, removed with it (issue 36): a config that still sets one is refused
# by name. torchrun's rendezvous (--rdzv-endpoint), its agents and --max-restarts do what they did.
_REMOVED_RANK_FIELDS = (
    "rank_timeout_s",
    "hostfile",
    "master_addr",
    "master_port",
    "rank_agent_join_s",
    "rank_heartbeat_lost_s",
)


class _Section(BaseModel):
    # Unknown keys are errors: a typo in a YAML file must not silently fall back to a default.
    # strict: no silent coercion (`n_samples: true` is not 1, `"3"` is not 3); ints are still accepted for
    # float fields. allow_inf_nan=False: a NaN weight or an infinite coefficient is refused, not trained on.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _floats_written_as_text(cls, data: Any) -> Any:
        # PyYAML reads YAML 1.1, where `1e-5` (no dot) is a string; a float field takes it as the number the
        # user meant. Only float fields, and only text that parses as a number ("nan" is then refused).
        if not isinstance(data, dict):
            return data
        fixed = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is not None and isinstance(value, str) and _takes_float(field.annotation):
                try:
                    fixed[name] = float(value)
                except ValueError:
                    pass
        return fixed


def _require_stage(stage: str) -> None:
    """ValueError naming `stage` and the stages when it is not a pipeline stage (a typo in a per-stage setting)."""
    if stage not in PIPELINE_STAGES:
        raise ValueError(f"unknown stage {stage!r}; the stages are {', '.join(PIPELINE_STAGES)}")
