"""The docs' configuration reference (docs/config-reference.md) is the one the config model generates, and the
concepts page's column mapping (docs/concepts.md) names real shard columns."""

import re
from pathlib import Path

import pyarrow as pa

from ppoflow.reference import config_reference_markdown
from storage.schema import schema_for

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_config_reference_in_sync():
    text = (DOCS / "config-reference.md").read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    block = text[text.index(start) + len(start) : text.index(end)].strip()
    assert block == config_reference_markdown().strip(), (
        "docs/config-reference.md out of date: run `make docs-reference` (scripts/docs_reference.py)"
    )


def test_every_config_field_documented():
    table = config_reference_markdown()
    from ppoflow.config import PPOFlowConfig

    for section, sfield in PPOFlowConfig.model_fields.items():
        for name, field in sfield.annotation.model_fields.items():
            assert f"`{section}.{name}`" in table
            assert field.description, f"{section}.{name} has no description"


def test_shard_column_mapping_names_every_tensor_column():
    # docs/concepts.md: each row maps ppoflow shard columns to OpenRLHF's and veRL's names; the first column names
    # only real experience-shard columns, and every list column plus the reward has a row
    text = (DOCS / "concepts.md").read_text()
    header = "| ppoflow column | OpenRLHF `Experience` field | veRL `DataProto` batch key |"
    rows = [row.split("|")[1:4] for row in text[text.index(header) :].split("\n\n")[0].splitlines()[2:]]
    names = [[set(re.findall(r"`(\w+)`", cell)) for cell in row] for row in rows]
    ours = set().union(*(row[0] for row in names))
    schema = schema_for("experience")
    assert ours <= set(schema.names)
    assert {f.name for f in schema if pa.types.is_list(f.type)} | {"reward"} <= ours
    # the names all three share are the value targets and advantages only (not the ids, log-probs or reward)
    shared = set().union(*(row[0] & row[1] & row[2] for row in names))
    assert shared == {"values", "advantages", "returns"}
