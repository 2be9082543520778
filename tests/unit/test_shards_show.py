"""`ppoflow shards show` on real-looking rows (chat-template prompts of many lines, token ids up to a 49k
vocabulary) stays readable on an 80-column terminal: every column's name whole, no line wider than the console."""

from __future__ import annotations

import io
import re

import numpy as np
import pyarrow as pa
import pytest
from rich.console import Console

from storage import fs as fsutil
from storage.inspect import shards_show
from storage.schema import schema_for
from storage.shards import write_shards
from storage.synthetic import synthetic_table

SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n"
)
QUESTION = (
    "Natalia sold clips to {n} of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?<|im_end|>\n<|im_start|>assistant\n"
)
RESPONSE = "Natalia sold {n}/2 = {h} clips in May.\nNatalia sold {n}+{h} = {t} clips altogether.\n#### {t}"


def _chat_rows(rows: int) -> pa.Table:
    """A scored table like SmolLM2-135M-Instruct's: prompts of 50-100 ids, responses of 16-64, ids < 49152."""
    rng = np.random.default_rng(3)
    table = synthetic_table("scored", rows, vocab=49152)
    schema = schema_for("scored")
    prompt_lengths, response_lengths = rng.integers(50, 101, rows), rng.integers(16, 65, rows)
    columns = {
        "prompt": [SYSTEM + QUESTION.format(n=2 * i + 40) for i in range(rows)],
        "response": [RESPONSE.format(n=2 * i + 40, h=i + 20, t=3 * i + 60) for i in range(rows)],
        "prompt_ids": [rng.integers(0, 49152, n).tolist() for n in prompt_lengths],
        "response_ids": [rng.integers(0, 49152, n).tolist() for n in response_lengths],
        "rollout_logprobs": [(-rng.exponential(1.0, n)).tolist() for n in response_lengths],
        "ref_logprobs": [(-rng.exponential(1.0, n)).tolist() for n in response_lengths],
    }
    for name, values in columns.items():
        table = table.set_column(
            schema.get_field_index(name), schema.field(name), pa.array(values, schema.field(name).type)
        )
    return table


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    table = _chat_rows(6)
    fs, folder = fsutil.resolve(str(tmp_path_factory.mktemp("shards") / "run" / "iter-000001" / "scored"))
    write_shards(fs, folder, table, "scored", max_rows=4)
    return folder, table


def _render(renderable, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


FIVE = ["prompt", "response", "prompt_ids", "reward", "finish_reason"]


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("columns", [None, FIVE, ["prompt", "response"]], ids=["all", "five", "two"])
def test_every_column_name_whole_and_no_line_wider_than_the_console(chat_folder, width, columns):
    folder, table = chat_folder
    text = _render(shards_show(folder, rows=3, columns=columns), width)
    lines = text.splitlines()
    assert max(map(len, lines)) <= width, "\n".join(line for line in lines if len(line) > width)
    for name in columns or schema_for("scored").names:  # a name, not the start of a longer one (prompt_ids)
        assert re.search(rf"(?<!\w){name}(?!\w)", text), f"column {name!r} not shown whole at width {width}"
    # A prompt's lines stay on one line (newlines shown as ⏎) and its id list starts with its length.
    assert "<|im_start|>system⏎You are" in text
    if columns != ["prompt", "response"]:
        assert f"[{len(table['prompt_ids'][0].as_py())}] {table['prompt_ids'][0][0].as_py()}," in text


def test_few_columns_side_by_side_when_they_fit(chat_folder):
    folder, _ = chat_folder
    wide = _render(shards_show(folder, rows=3, columns=FIVE), 120)
    assert any(
        re.search(r"prompt\W+response\W+prompt_ids\W+reward\W+finish_reason", line) for line in wide.splitlines()
    )
    assert "row 0" not in wide
    narrow = _render(shards_show(folder, rows=3, columns=FIVE), 80)
    assert [line.split()[0] for line in narrow.splitlines() if line.startswith("  ")][:5] == FIVE  # one block a row
