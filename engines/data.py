"""The prompt source: which prompts an iteration trains on, as a pure function of (seed, iteration).

The dataset is a `datasets` folder (`save_to_disk`), a `.jsonl` or a `.parquet` file. The data order is a
seeded permutation per epoch: epoch e visits the rows in `permutation(seed, e)`, and iteration i takes the
`count` positions starting at `i * count` of the endless concatenation of those epochs. So the "data
cursor" is simply the iteration number: resuming at iteration i gives exactly the prompts an
uninterrupted run would have seen, with no cursor state to save.

Tokenisation: the prompt text (wrapped with the tokenizer's chat template when the config asks and the
tokenizer has one) is encoded once up front, so an over-long prompt is an error naming its row before any
expensive work starts.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of an iteration. `index` is the dataset row; `prompt_ids` (prompt_len,) as sent to rollout."""

    index: int
    text: str
    prompt_ids: list[int]
    label: Any
    data_source: Optional[str]


class DataError(ValueError):
    """A dataset that cannot be trained on; the message names the file and the line or row."""


_BLOCK_BYTES = 16 * 2**20


def _utf8_problem(path: Path) -> Optional[str]:
    """The first bytes of a file that are not UTF-8, named by line and byte; None when it all decodes.

    Read in blocks of whole lines (~0.25 s for 50 MB): datasets and pyarrow both replace such bytes without
    a word, so a label could silently change.
    """
    line = 1
    with open(path, "rb") as f:
        while block := f.read(_BLOCK_BYTES):
            block += f.readline()  # end the block at a line end, so no character is cut in two
            try:
                block.decode("utf-8")
            except UnicodeDecodeError as e:
                before = block[: e.start]
                column = e.start - (before.rfind(b"\n") + 1)
                line += before.count(b"\n")
                return (
                    f"dataset {str(path)!r} line {line}: not UTF-8 "
                    f"(byte 0x{block[e.start]:02x} at byte {column} of the line)"
                )
            line += block.count(b"\n")
    return None


def _arrow_rows(path: Path, keys: list[tuple[str, str]]) -> Optional[int]:
    """Rows of a .jsonl file parsed by pyarrow's streaming reader (C++, memory flat; ~1.7 s for 1M rows
    where json.loads per line took ~9 s), or None when anything looks wrong: then `_jsonl_problem` reads it
    line by line to name the line. Looks wrong: a parse error, a column missing or null somewhere, a prompt
    column that is not text, a prompt that is empty or only whitespace."""
    import pyarrow as pa
    import pyarrow.json as pj

    rows = 0
    try:
        for batch in pj.open_json(path):
            for i, (_role, key) in enumerate(keys):
                column = batch.schema.field(key) if key in batch.schema.names else None
                if column is None or batch.column(key).null_count:
                    return None
                if i == 0 and not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
                    return None
            if keys and _first_blank(batch.column(keys[0][1])) is not None:
                return None
            rows += batch.num_rows
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError):
        return None
    return rows


def _jsonl_problem(
    path: Path, keys: list[tuple[str, str]], label_readers: Sequence[str] = ()
) -> tuple[int, Optional[str]]:
    """(rows, the first problem or None) of a .jsonl file, read as a stream (memory stays flat).

    A problem names the file and the 1-based line: bytes that are not UTF-8, a line that is not a JSON
    object, a missing key (`keys` holds (config field, key)), a prompt that is not a string or is empty or
    only whitespace, a null label when `label_readers` (reward sources, named) are passed labels. Blank lines
    are skipped (datasets skips them too). The slow, exact reader: used when a fast check found something.
    """
    rows = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"dataset {str(path)!r} line {number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return rows, f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the line)"
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                return rows, f"{where}: not JSON ({e.msg} at column {e.colno})"
            if not isinstance(record, dict):
                return rows, f"{where}: a JSON {type(record).__name__}, expected an object with the columns"
            for role, key in keys:
                if key not in record:
                    return rows, f"{where}: no key {key!r} ({role}); keys present: {sorted(record)}"
            if keys and not isinstance(record[keys[0][1]], str):
                return rows, (
                    f"{where}: the prompt ({keys[0][0]}={keys[0][1]!r}) is a "
                    f"{type(record[keys[0][1]]).__name__}, expected text"
                )
            if keys and not record[keys[0][1]].strip():
                return rows, f"{where}: {_blank_prompt(record[keys[0][1]], keys[0][1])}"
            label_key = dict(keys).get("data.label_key")
            if label_readers and label_key is not None and record[label_key] is None:
                return rows, f"{where}: {_null_label(label_key, label_readers)}"
            rows += 1
    return rows, None


def _blank_prompt(text: Optional[str], prompt_key: str) -> str:
    what = "null" if text is None else "empty" if not text else f"only whitespace ({text!r})"
    return (
        f"the prompt (data.prompt_key={prompt_key!r}) is {what}: a reward for a response to no question "
        f"means nothing; drop the row"
    )


def _null_label(label_key: str, label_readers: Sequence[str]) -> str:
    return (
        f"the label (data.label_key={label_key!r}) is null, and {', '.join(label_readers)} would be passed it "
        f"as None; fill it in or drop the row (or set data.label_key: null when no reward source uses labels: "
        f"every label is then None)"
    )


def _first_blank(prompts) -> Optional[int]:
    """Index of the first null, empty or whitespace-only string of an Arrow string array, or None."""
    import pyarrow.compute as pc

    blank = pc.or_kleene(pc.is_null(prompts), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(prompts)), 0))
    index = pc.index(blank, True).as_py()
    return None if index < 0 else index


def _row_problem(path: Path, data_cfg, label_readers: Sequence[str]) -> Optional[str]:
    """The first 0-based row of a .parquet file or datasets folder whose prompt is null, empty or only
    whitespace, or whose label is null while `label_readers` are passed labels. Reads those columns only,
    as Arrow arrays (no Python objects)."""
    import pyarrow.compute as pc

    names = [data_cfg.prompt_key] + ([data_cfg.label_key] if label_readers and data_cfg.label_key else [])
    if path.is_dir():
        # memory-mapped; taken through the dataset's indices, so row numbers are PromptSource's
        table = load_rows(str(path)).select_columns(names).with_format("arrow")[:]
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=names)
    where = f"dataset {str(path)!r} row"
    if (row := _first_blank(table.column(data_cfg.prompt_key))) is not None:
        return f"{where} {row}: {_blank_prompt(table.column(data_cfg.prompt_key)[row].as_py(), data_cfg.prompt_key)}"
    if len(names) > 1 and (row := pc.index(pc.is_null(table.column(names[1])), True).as_py()) >= 0:
        return f"{where} {row}: {_null_label(names[1], label_readers)}"
    return None


def _column_keys(data_cfg) -> list[tuple[str, str]]:
    """(config field, column) for the columns the config names; the prompt first."""
    keys = [
        ("data.prompt_key", data_cfg.prompt_key),
        ("data.label_key", data_cfg.label_key),
        ("data.data_source_key", data_cfg.data_source_key),
    ]
    return [(role, key) for role, key in keys if key is not None]


def check_dataset(data_cfg, label_readers: Sequence[str] = ()) -> int:
    """Check that `data_cfg.path` can be trained on, without tokenising it; return its row count.

    Cheap by format: a .jsonl is checked for UTF-8 in blocks, then parsed by pyarrow's streaming reader
    (keys on every line: datasets fills a key a line lacks with null, which would reach the reward function
    as a missing label); only when that finds something is it read line by line, to name the line (1M
    rows: ~2 s, against ~9 s for json.loads per line). A .parquet file and a datasets folder are checked
    from their schema and row count, then their prompt (and label) column is read as Arrow arrays. Prompt
    lengths are PromptSource's job (it tokenises once and names the row).

    `label_readers` names the reward sources that are passed each sample's label ("reward.sources.0
    (function my.py:fn)"); with any, a null label is refused: it would reach them as None without a word.

    Raises DataError naming the file, and the line for a .jsonl (the 0-based row otherwise): missing or
    unreadable path, unsupported type, bytes that are not UTF-8, a line that is not a JSON object, a missing
    column, a prompt column that is not text, a prompt that is empty or only whitespace, a null label (with
    `label_readers`), no rows.
    """
    path = Path(data_cfg.path).expanduser()
    keys = _column_keys(data_cfg)
    if not path.exists():
        raise DataError(f"dataset {data_cfg.path!r} not found (data.path: a datasets folder, .jsonl or .parquet)")
    if not os.access(path, os.R_OK):
        raise DataError(f"dataset {data_cfg.path!r} is not readable by this user (data.path)")
    if path.is_dir():
        columns, types, rows = _folder_schema(path)
    elif path.suffix == ".jsonl":
        problem = _utf8_problem(path)
        rows = None if problem else _arrow_rows(path, keys)
        if rows is None and problem is None:
            rows, problem = _jsonl_problem(path, keys, label_readers)
        if problem:
            raise DataError(problem)
        if rows == 0:
            raise DataError(f"dataset {data_cfg.path!r} is empty: no JSON lines (data.path)")
        return rows
    elif path.suffix == ".parquet":
        columns, types, rows = _parquet_schema(path)
    else:
        raise DataError(
            f"dataset {data_cfg.path!r}: unsupported file type {path.suffix!r} "
            f"(data.path: a datasets folder, .jsonl or .parquet)"
        )
    for role, key in keys:
        if key not in columns:
            raise DataError(f"dataset {data_cfg.path!r} has no column {key!r} ({role}); columns present: {columns}")
    prompt_type = types[columns.index(keys[0][1])]
    if prompt_type not in ("string", "large_string"):
        raise DataError(
            f"dataset {data_cfg.path!r}: the prompt column {keys[0][1]!r} holds {prompt_type}, "
            f"expected text (data.prompt_key)"
        )
    if rows == 0:
        raise DataError(f"dataset {data_cfg.path!r} has no rows (data.path)")
    if problem := _row_problem(path, data_cfg, label_readers):
        raise DataError(problem)
    return rows


def _parquet_schema(path: Path) -> tuple[list[str], list[str], int]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow names neither the file nor the column: say which file
        raise DataError(f"dataset {str(path)!r} is not a readable Parquet file: {e}") from None
    schema = meta.schema.to_arrow_schema()
    return list(schema.names), [str(t) for t in schema.types], meta.num_rows


def _folder_schema(path: Path) -> tuple[list[str], list[str], int]:
    try:
        rows = load_rows(str(path))  # memory-mapped Arrow: the schema and length, no rows read
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"dataset folder {str(path)!r} cannot be opened with datasets.load_from_disk: {type(e).__name__}: {e}"
        ) from None
    schema = rows.data.schema
    return list(schema.names), [str(t) for t in schema.types], len(rows)


def load_rows(path: str) -> Any:
    """A `datasets.Dataset` from a save_to_disk folder, a .jsonl or a .parquet file."""
    import datasets

    p = Path(path)
    if p.is_dir():
        loaded = datasets.load_from_disk(str(p))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"dataset {path!r} is a DatasetDict without a 'train' split (has {list(loaded)})")
            loaded = loaded["train"]
        return loaded
    if not p.is_file():
        raise FileNotFoundError(f"dataset {path!r} not found (data.path: a datasets folder, .jsonl or .parquet)")
    if p.suffix == ".jsonl":
        # datasets replaces bytes that are not UTF-8 without a word (a label would silently change): refuse.
        problem = _utf8_problem(p)
        if problem:
            raise DataError(problem)
        try:
            return datasets.Dataset.from_json(str(p))
        except Exception:
            # datasets' own error names neither the file nor the line: find the first bad line ourselves
            # (only on failure, so a good file is read once).
            rows, problem = _jsonl_problem(p, [])
            if problem or rows == 0:
                raise DataError(problem or f"dataset {path!r} is empty: no JSON lines (data.path)") from None
            raise
    if p.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(p))
    raise DataError(f"dataset {path!r}: unsupported file type {p.suffix!r} (use a datasets folder, .jsonl or .parquet)")


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch: a permutation of range(num_rows) fixed by (seed, epoch)."""
    order = list(range(num_rows))
    random.Random(f"ppoflow-data-{seed}-{epoch}").shuffle(order)
    return order


class PromptSource:
    """Prompts for each iteration, deterministic from (seed, iteration).

    Raises (at construction) KeyError naming a missing column and the columns present, ValueError naming
    the first row whose prompt is empty, only whitespace, or longer than data.max_prompt_tokens.
    """

    def __init__(self, data_cfg, tokenizer, apply_chat_template: bool = False):
        self.cfg = data_cfg
        self.tokenizer = tokenizer
        rows = load_rows(data_cfg.path)
        columns = list(rows.column_names)
        for role, key in (
            ("data.prompt_key", data_cfg.prompt_key),
            ("data.label_key", data_cfg.label_key),
            ("data.data_source_key", data_cfg.data_source_key),
        ):
            if key is not None and key not in columns:
                raise KeyError(f"dataset {data_cfg.path!r} has no column {key!r} ({role}); columns present: {columns}")
        if len(rows) == 0:
            raise ValueError(f"dataset {data_cfg.path!r} has no rows")
        self.use_chat_template = bool(apply_chat_template and getattr(tokenizer, "chat_template", None))
        prompts = rows[data_cfg.prompt_key]
        for row, text in enumerate(prompts):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"dataset {data_cfg.path!r} row {row}: {_blank_prompt(text, data_cfg.prompt_key)}")
        self.texts: list[str] = [self._render(t) for t in prompts]
        self.labels = rows[data_cfg.label_key] if data_cfg.label_key else [None] * len(rows)
        self.data_sources = rows[data_cfg.data_source_key] if data_cfg.data_source_key else [None] * len(rows)
        self.prompt_ids: list[list[int]] = [self._encode(i, t) for i, t in enumerate(self.texts)]

    def __len__(self) -> int:
        return len(self.texts)

    def _render(self, text: str) -> str:
        if not self.use_chat_template:
            return text
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    def _encode(self, row: int, text: str) -> list[int]:
        # A chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS).
        ids = list(self.tokenizer(text, add_special_tokens=not self.use_chat_template)["input_ids"])
        if not ids:
            raise ValueError(f"dataset {self.cfg.path!r} row {row}: prompt is empty after tokenisation")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise ValueError(
                f"dataset {self.cfg.path!r} row {row}: prompt has {len(ids)} tokens, more than "
                f"data.max_prompt_tokens={self.cfg.max_prompt_tokens}"
            )
        return ids

    def row_indices(self, iteration: int, count: int, seed: int) -> list[int]:
        """Dataset rows of `iteration`: positions [iteration*count, (iteration+1)*count) of the epoch stream."""
        if iteration < 0 or count < 1:
            raise ValueError(f"iteration must be >= 0 and count >= 1 (got {iteration}, {count})")
        n = len(self)
        start = iteration * count
        rows: list[int] = []
        epoch, offset = divmod(start, n)
        while len(rows) < count:
            order = epoch_permutation(n, seed, epoch)
            take = order[offset : offset + count - len(rows)]
            rows.extend(take)
            epoch, offset = epoch + 1, 0
        return rows

    def prompts_for_iteration(self, iteration: int, count: int, seed: int) -> list[PromptRecord]:
        """`count` prompts of `iteration`; the same (seed, iteration, count) always gives the same list."""
        return self.records(self.row_indices(iteration, count, seed))

    def records(self, rows: list[int]) -> list[PromptRecord]:
        """The prompts of these dataset rows, in that order (IndexError for a row outside the dataset)."""
        return [
            PromptRecord(
                index=i,
                text=self.texts[i],
                prompt_ids=list(self.prompt_ids[i]),
                label=self.labels[i],
                data_source=self.data_sources[i],
            )
            for i in rows
        ]
