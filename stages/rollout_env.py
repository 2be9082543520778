"""The rollout stage's multi-turn path (rollout.environment set): prompts -> conversations -> rollout rows.

    sample_conversations(engine, source, cfg, iteration, records, seeds) -> rollout rows (multi-turn columns)
    environment_factory(cfg) -> EnvironmentFactory        the configured environment, loaded once per process
    environment_identity(cfg) -> str | None               what the rollout's cache key holds of it

The compute is engines/rollout/multi_turn.py; this layer finds the environment, the dataset rows it is reset
with and the rows' seeds, exactly as the single-turn path finds its prompts (stages/rollout.py), so
dynamic sampling and rollout parts go through it unchanged.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import pyarrow as pa

from engines.data import PromptSource, load_rows
from engines.environments.loader import EnvironmentFactory, load_environment_factory
from engines.rollout.base import RolloutEngine, SamplingSettings
from engines.rollout.multi_turn import ConversationStart, TurnLimits, run_conversations
from stages.env_failures import drop_failed_groups, with_accounting
from stages.tables import rollout_table


@functools.lru_cache(maxsize=4)
def _factory(source: str, file_state: Optional[tuple]) -> EnvironmentFactory:
    return load_environment_factory(source)


def _file_state(source: str) -> Optional[tuple]:
    """(mtime, size) of a file spec's file, so an edited environment file is loaded again; None for a module."""
    where = source.rpartition(":")[0]
    try:
        stat = os.stat(where) if where.endswith(".py") else None
    except OSError:
        return None
    return None if stat is None else (stat.st_mtime_ns, stat.st_size)


def environment_factory(cfg) -> EnvironmentFactory:
    """The factory of rollout.environment.source (the loader's errors name the spec)."""
    source = cfg.rollout.environment.source
    return _factory(source, _file_state(source))


def environment_identity(cfg) -> Optional[str]:
    """The environment's identity (spec, code, declared packages) for the rollout's cache key; None single-turn."""
    return None if cfg.rollout.environment is None else environment_factory(cfg).identity


@functools.lru_cache(maxsize=2)
def _dataset(path: str, file_state: tuple):
    return load_rows(path)


def _dataset_rows(path: str, indices: list[int]) -> list[dict]:
    """The rows `indices` of the dataset at `path` (every column as read, plus "index"): what env.reset sees."""
    stat = os.stat(path)
    rows = _dataset(os.path.abspath(path), (stat.st_mtime_ns, stat.st_size))
    return [{**rows[i], "index": i} for i in indices]


def conversation_starts(source: PromptSource, cfg, records: list, seeds: list[int]) -> list[ConversationStart]:
    """One ConversationStart per prompt record of `source` (the training prompts, or the eval stage's held-out
    ones: the rows env.reset sees are read from the file `source` was read from); ValueError unless the prompts
    were rendered with a chat template (multi-turn appends messages to it)."""
    if not source.use_chat_template:
        raise ValueError(
            f"rollout.environment needs the tokenizer of {cfg.model.policy_path!r} to have a chat template and "
            f"model.apply_chat_template=true: the conversation is built with it turn by turn"
        )
    rows = _dataset_rows(source.cfg.path, [r.index for r in records])
    key = source.cfg.prompt_key
    return [
        ConversationStart(
            index=r.index, row=row, prompt=row[key], prompt_text=r.text, prompt_ids=list(r.prompt_ids), seed=seed
        )
        for r, row, seed in zip(records, rows, seeds)
    ]


def sample_conversations(
    engine: RolloutEngine, source: PromptSource, cfg, iteration: int, records: list, seeds: list[int]
) -> pa.Table:
    """`records` (PromptRecord) as n conversations each with the configured environment, as multi-turn rollout
    rows ordered by (prompt, sample); a group with a failed environment is dropped whole and counted in the
    table's metadata (stages/env_failures.py). Errors: EnvironmentFailuresExceeded past
    rollout.environment.max_failed_group_share (naming the environment, the rows, the first error), the loader's
    (naming the spec), the engine's (naming the prompt)."""
    starts = conversation_starts(source, cfg, records, seeds)
    limits = TurnLimits.from_config(cfg.rollout.environment)
    sampling = SamplingSettings.from_config(cfg.rollout)
    factory = environment_factory(cfg)
    samples = run_conversations(engine, source.tokenizer, factory, starts, sampling, limits, on_env_failure="record")
    env = cfg.rollout.environment
    kept, accounting = drop_failed_groups(samples, records, env.source, env.max_failed_group_share)
    return with_accounting(rollout_table(records, kept, source.tokenizer, iteration), accounting)
