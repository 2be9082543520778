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

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of an iteration. `index` is the dataset row; `prompt_ids` (prompt_len,) as sent to rollout."""

    index: int
    text: str
    prompt_ids: list[int]
    label: Any
    data_source: Optional[str]


def _load_rows(path: str) -> Any:
    """A `datasets.Dataset` from a save_to_disk folder, a .jsonl or a .parquet file."""
    import datasets

    p = Path(path)
    if p.is_dir():
        loaded = datasets.load_from_disk(str(p))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"dataset {path!r} is a DatasetDict without a 'train' split (has {list(loaded)})")
            loaded = loaded["train"]
        return loaded
    if not p.is_file():
        raise FileNotFoundError(f"dataset {path!r} not found (data.path: a datasets folder, .jsonl or .parquet)")
    if p.suffix == ".jsonl":
        return datasets.Dataset.from_json(str(p))
    if p.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(p))
    raise ValueError(f"dataset {path!r}: unsupported file type {p.suffix!r} (use a datasets folder, .jsonl or .parquet)")


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch: a permutation of range(num_rows) fixed by (seed, epoch)."""
    order = list(range(num_rows))
    random.Random(f"ppoflow-data-{seed}-{epoch}").shuffle(order)
    return order


class PromptSource:
    """Prompts for each iteration, deterministic from (seed, iteration).

    Raises (at construction) KeyError naming a missing column and the columns present, ValueError naming
    the first row whose prompt is empty or longer than data.max_prompt_tokens.
    """

    def __init__(self, data_cfg, tokenizer, apply_chat_template: bool = False):
        self.cfg = data_cfg
        self.tokenizer = tokenizer
        rows = _load_rows(data_cfg.path)
        columns = list(rows.column_names)
        for role, key in (("data.prompt_key", data_cfg.prompt_key), ("data.label_key", data_cfg.label_key),
                          ("data.data_source_key", data_cfg.data_source_key)):
            if key is not None and key not in columns:
                raise KeyError(f"dataset {data_cfg.path!r} has no column {key!r} ({role}); columns present: {columns}")
        if len(rows) == 0:
            raise ValueError(f"dataset {data_cfg.path!r} has no rows")
        self.use_chat_template = bool(apply_chat_template and getattr(tokenizer, "chat_template", None))
        self.texts: list[str] = [self._render(t) for t in rows[data_cfg.prompt_key]]
        self.labels = rows[data_cfg.label_key] if data_cfg.label_key else [None] * len(rows)
        self.data_sources = rows[data_cfg.data_source_key] if data_cfg.data_source_key else [None] * len(rows)
        self.prompt_ids: list[list[int]] = [self._encode(i, t) for i, t in enumerate(self.texts)]

    def __len__(self) -> int:
        return len(self.texts)

    def _render(self, text: str) -> str:
        if not self.use_chat_template:
            return text
        return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)

    def _encode(self, row: int, text: str) -> list[int]:
        # A chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS).
        ids = list(self.tokenizer(text, add_special_tokens=not self.use_chat_template)["input_ids"])
        if not ids:
            raise ValueError(f"dataset {self.cfg.path!r} row {row}: prompt is empty after tokenisation")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise ValueError(f"dataset {self.cfg.path!r} row {row}: prompt has {len(ids)} tokens, more than "
                             f"data.max_prompt_tokens={self.cfg.max_prompt_tokens}")
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
            take = order[offset:offset + count - len(rows)]
            rows.extend(take)
            epoch, offset = epoch + 1, 0
        return rows

    def prompts_for_iteration(self, iteration: int, count: int, seed: int) -> list[PromptRecord]:
        """`count` prompts of `iteration`; the same (seed, iteration, count) always gives the same list."""
        return [PromptRecord(index=i, text=self.texts[i], prompt_ids=list(self.prompt_ids[i]),
                             label=self.labels[i], data_source=self.data_sources[i])
                for i in self.row_indices(iteration, count, seed)]
