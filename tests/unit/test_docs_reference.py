"""The README's config reference is the one the config model generates, and its commands exist."""

import re
from pathlib import Path

import pyarrow as pa

from ppoflow.reference import config_reference_markdown
from storage.schema import schema_for

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


def test_shard_column_mapping_names_every_tensor_column():
    # "Concepts, for OpenRLHF and veRL users": each row maps ppoflow shard columns to OpenRLHF's and veRL's names;
    # the first column names only real experience-shard columns, and every list column plus the reward has a row
    text = README.read_text()
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
