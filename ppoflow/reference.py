"""The config reference, generated from the config model (docs/config-reference.md's table comes from here)."""

from __future__ import annotations

from pydantic import BaseModel

from ppoflow.config import PPOFlowConfig


def _default_text(field) -> str:
    if field.default_factory is not None:
        machine_dependent = getattr(field.default_factory, "reference", None)
        if machine_dependent is not None:
            return machine_dependent
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{value!r}`" if not isinstance(value, list) or len(repr(value)) < 60 else "(see code)"
    return f"`{field.default!r}`"


def config_reference_markdown() -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for section, sfield in PPOFlowConfig.model_fields.items():
        lines += _rows(section, sfield.annotation)
    return "\n".join(lines)


def _rows(prefix: str, model) -> list[str]:
    """One row per field; a nested section (e.g. rollout.dynamic_sampling) gets its row, then its fields'."""
    rows = []
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}.{name}` | {_default_text(field)} | {desc} |")
        if field.default_factory is not None and isinstance(field.default_factory(), BaseModel):
            rows += _rows(f"{prefix}.{name}", type(field.default_factory()))
    return rows
