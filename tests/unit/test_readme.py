"""The README's config reference is the one the config model generates, and its commands exist."""

from pathlib import Path

from ppoflow.reference import config_reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_config_reference_in_sync():
    text = README.read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    block = text[text.index(start) + len(start) : text.index(end)].strip()
    assert block == config_reference_markdown().strip(), "README out of date: paste `ppoflow config-reference`"


def test_every_config_field_documented():
    table = config_reference_markdown()
    from ppoflow.config import PPOFlowConfig

    for section, sfield in PPOFlowConfig.model_fields.items():
        for name, field in sfield.annotation.model_fields.items():
            assert f"`{section}.{name}`" in table
            assert field.description, f"{section}.{name} has no description"
