"""Preference pairs for reward-model training: load, check, render, tokenize, split off the eval pairs.

Input: a datasets folder (save_to_disk), a .jsonl or a .parquet file with a prompt, a chosen and a
rejected column (names from the rm_train section) and optionally a margin column. Each of prompt / chosen /
rejected is either plain text or a list of chat messages ({"role", "content"}).

What the model sees must be what the score stage's `kind: model` source will later score, so:
- plain text: the text `prompt + response` (OpenRLHF's `queries`, no separator added);
- chat (any of the three is a message list): the tokenizer's chat template over the prompt messages then
  the response messages (a plain prompt becomes one user message, a plain response one assistant message);
and either text is tokenized as engines/rewards/model.py tokenizes its queries: with the tokenizer's
special tokens (BOS), even after a chat template, because that is what the reward source will score.

Bad rows (a missing or empty field, a field of another type, chosen == rejected) are an error naming the
row, or dropped and counted when rm_train.bad_rows is "drop". A pair longer than rm_train.max_length
tokens follows rm_train.truncation: an error naming the row, dropped and counted, or cut from the left
(the prompt's side; a leading BOS is kept), so the responses, which decide the preference, stay whole.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from engines.data import load_rows  # the one loader of datasets folders / .jsonl / .parquet


class PreferenceDataError(ValueError):
    """A preference row or file that cannot be used; the message names the file and the row."""


@dataclass
class PreferencePairs:
    """Tokenized pairs. chosen_ids / rejected_ids: P ragged lists of token ids; margins (P,); rows: the
    source row of each pair (for error messages and for tests)."""

    chosen_ids: list[list[int]] = field(default_factory=list)
    rejected_ids: list[list[int]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        """The longer side of each pair, in tokens: what its padded rows cost."""
        return [max(len(c), len(r)) for c, r in zip(self.chosen_ids, self.rejected_ids)]

    def subset(self, indices: list[int]) -> "PreferencePairs":
        return PreferencePairs(
            [self.chosen_ids[i] for i in indices],
            [self.rejected_ids[i] for i in indices],
            [self.margins[i] for i in indices],
            [self.rows[i] for i in indices],
        )


def _is_messages(value: Any) -> bool:
    return isinstance(value, list)


def _check_field(value: Any, name: str, where: str) -> Optional[str]:
    """Why `value` is not a usable prompt / response, or None when it is."""
    if value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, list) and not value):
        return f"{where}: {name} is missing or empty"
    if isinstance(value, str):
        return None
    if isinstance(value, list):
        for k, message in enumerate(value):
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                return f"{where}: {name} message {k} is not a {{role, content}} mapping of strings"
        return None
    return f"{where}: {name} is a {type(value).__name__}, expected text or a list of chat messages"


def _as_messages(value: Any, role: str) -> list[dict]:
    return value if _is_messages(value) else [{"role": role, "content": value}]


def render(prompt: Any, response: Any, tokenizer, where: str = "a row") -> tuple[str, bool]:
    """(text, is_chat) that the model scores for one side of a pair; see the module docstring."""
    if not (_is_messages(prompt) or _is_messages(response)):
        return prompt + response, False
    if not getattr(tokenizer, "chat_template", None):
        raise PreferenceDataError(f"{where} holds chat messages but the tokenizer has no chat template")
    messages = _as_messages(prompt, "user") + _as_messages(response, "assistant")
    return tokenizer.apply_chat_template(messages, tokenize=False), True


class _Truncator:
    """Applies rm_train.truncation to one side's token ids; returns None when the pair is to be dropped."""

    def __init__(self, rm_cfg, bos_id: Optional[int]):
        self.max_length, self.policy, self.bos_id = rm_cfg.max_length, rm_cfg.truncation, bos_id

    def __call__(self, ids: list[int], where: str, side: str) -> Optional[list[int]]:
        if len(ids) <= self.max_length:
            return ids
        if self.policy == "error":
            raise PreferenceDataError(
                f"{where}: prompt + {side} has {len(ids)} tokens, more than "
                f"rm_train.max_length={self.max_length} (rm_train.truncation: error; "
                f"'drop' or 'truncate_left' allowed)"
            )
        if self.policy == "drop":
            return None
        keep_bos = self.bos_id is not None and ids[0] == self.bos_id
        head = ids[:1] if keep_bos else []
        return head + ids[len(ids) - (self.max_length - len(head)) :]


def tokenize_pairs(rows, rm_cfg, tokenizer, source: str) -> tuple[PreferencePairs, Counter]:
    """Check, render and tokenize every row of `rows` (a datasets.Dataset) -> (pairs, dropped counts by reason).

    Raises KeyError naming a missing column, PreferenceDataError naming the first bad row (under "error").
    """
    columns = list(rows.column_names)
    keys = {
        "rm_train.prompt_key": rm_cfg.prompt_key,
        "rm_train.chosen_key": rm_cfg.chosen_key,
        "rm_train.rejected_key": rm_cfg.rejected_key,
        "rm_train.margin_key": rm_cfg.margin_key,
    }
    for role, key in keys.items():
        if key is not None and key not in columns:
            raise KeyError(f"preference data {source!r} has no column {key!r} ({role}); columns present: {columns}")
    dropped: Counter = Counter()
    texts: list[tuple[int, str, str, bool, float]] = []
    prompts, chosens, rejecteds = rows[rm_cfg.prompt_key], rows[rm_cfg.chosen_key], rows[rm_cfg.rejected_key]
    margins = rows[rm_cfg.margin_key] if rm_cfg.margin_key else [0.0] * len(rows)
    for i, (prompt, chosen, rejected, margin) in enumerate(zip(prompts, chosens, rejecteds, margins)):
        where = f"preference data {source!r} row {i}"
        problem = next(
            (
                p
                for p in (
                    _check_field(prompt, rm_cfg.prompt_key, where),
                    _check_field(chosen, rm_cfg.chosen_key, where),
                    _check_field(rejected, rm_cfg.rejected_key, where),
                )
                if p
            ),
            None,
        )
        if problem is None and not isinstance(margin, (int, float)):
            problem = f"{where}: margin {margin!r} is not a number"
        if problem is None:
            text_c, chat = render(prompt, chosen, tokenizer, where)
            text_r, _ = render(prompt, rejected, tokenizer, where)
            if text_c == text_r:
                problem = f"{where}: chosen and rejected are the same text"
        if problem is not None:
            if rm_cfg.bad_rows == "error":
                raise PreferenceDataError(problem + " (rm_train.bad_rows: error; 'drop' skips such rows)")
            dropped["bad_row"] += 1
            continue
        texts.append((i, text_c, text_r, chat, float(margin)))
    return _encode(texts, rm_cfg, tokenizer, source, dropped), dropped


def _encode(texts, rm_cfg, tokenizer, source: str, dropped: Counter) -> PreferencePairs:
    pairs = PreferencePairs()
    truncate = _Truncator(rm_cfg, tokenizer.bos_token_id)
    chosen_ids = tokenizer([t[1] for t in texts], add_special_tokens=True)["input_ids"] if texts else []
    rejected_ids = tokenizer([t[2] for t in texts], add_special_tokens=True)["input_ids"] if texts else []
    for (row, _c, _r, _chat, margin), ids_c, ids_r in zip(texts, chosen_ids, rejected_ids):
        where = f"preference data {source!r} row {row}"
        ids_c, ids_r = truncate(list(ids_c), where, "chosen"), truncate(list(ids_r), where, "rejected")
        if ids_c is None or ids_r is None:
            dropped["too_long"] += 1
            continue
        pairs.chosen_ids.append(ids_c)
        pairs.rejected_ids.append(ids_r)
        pairs.margins.append(margin)
        pairs.rows.append(row)
    return pairs


def split_indices(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) positions of `count` pairs: a seeded shuffle, the first round(count * fraction) held out
    (at least one when fraction > 0 and count > 1). Both lists sorted."""
    order = list(range(count))
    random.Random(f"ppoflow-rm-split-{seed}").shuffle(order)
    held = round(count * fraction)
    if fraction > 0 and count > 1:
        held = min(max(held, 1), count - 1)
    return sorted(order[held:]), sorted(order[:held])


@dataclass
class PreferenceData:
    """The training and eval pairs and what was dropped on the way ({"train/bad_row": n, ...})."""

    train: PreferencePairs
    eval: PreferencePairs
    dropped: dict[str, int]


def load_preferences(rm_cfg, tokenizer, seed: int) -> PreferenceData:
    """Load data_path (and eval_path), tokenize, split. Raises FileNotFoundError / KeyError /
    PreferenceDataError naming the file, the column or the row; PreferenceDataError when no training pair is left."""
    pairs, dropped = tokenize_pairs(load_rows(rm_cfg.data_path), rm_cfg, tokenizer, rm_cfg.data_path)
    counts = {f"train/{k}": v for k, v in dropped.items()}
    if rm_cfg.eval_path:
        train = pairs
        evaluation, eval_dropped = tokenize_pairs(load_rows(rm_cfg.eval_path), rm_cfg, tokenizer, rm_cfg.eval_path)
        counts.update({f"eval/{k}": v for k, v in eval_dropped.items()})
    else:
        train_idx, eval_idx = split_indices(len(pairs), rm_cfg.eval_fraction, seed)
        train, evaluation = pairs.subset(train_idx), pairs.subset(eval_idx)
    if len(train) < rm_cfg.batch_size:
        raise PreferenceDataError(
            f"preference data {rm_cfg.data_path!r}: {len(train)} training pairs left "
            f"(dropped: {counts or 'none'}), fewer than rm_train.batch_size={rm_cfg.batch_size}"
        )
    return PreferenceData(train, evaluation, counts)
