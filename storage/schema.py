"""The shard schemas (rollout, scored, experience) and their version: the one place they are defined.

Column names follow OpenRLHF's Experience and veRL's DataProto. One row per sample; per-token arrays
are list columns of the response's length (no padding, so no mask is needed: every element is a
response token).

rollout:    iteration, prompt_index, sample_index (int32), prompt_hash (sha256 hex of the prompt ids),
            prompt, response (text), prompt_ids, response_ids (list<int32>),
            rollout_logprobs (list<float32>, len = response), finish_reason ("stop" | "length"),
            policy_version (int32), label, data_source (string, nullable)
scored:     rollout + reward (float32, weighted and clipped), reward_components (JSON object
            name -> float), ref_logprobs (list<float32>, len = response), score_cache_hit (bool)
experience: scored + old_logprobs, values, advantages, returns (list<float32>, len = response)
eval:       the scored columns, for the eval stage's samples of the held-out prompts (eval.data_path); with
            rollout.environment set they are conversations, with the multi-turn columns below

Multi-turn rows (rollout.environment set, engines/rollout/multi_turn.py) carry four more columns, right after
the rollout columns in every kind; `response_ids` then holds everything after the first prompt, the policy's
turns and the environment's messages in order:
            token_owner (list<int8>, len = response): 1 = the policy sampled the token (trained, takes KL),
                        0 = the environment's (an observation rendered by the chat template: context only;
                        its rollout_logprobs are 0 and never read)
            turn_starts (list<int32>): index in response_ids where each message after the first prompt starts
                        (policy turn, observation, policy turn, ...); token_owner says whose each one is
            env_reward (float32): the sum of the environment's per-turn rewards; turns (int32): policy turns
            truncation (string, nullable): null when the environment ended the episode (finish_reason "stop"),
                        "max_turns" or "max_total_tokens" when a limit did (finish_reason "length")
            env_info (string): JSON list of each environment step's Observation.info, in turn order (read by
                        people, never by training)

Curriculum rows (data.reasoning_gym.curriculum set, engines/curriculum.py) carry one more column, after the rollout
(and multi-turn) columns in every kind:
            curriculum_level (int32): the curriculum level the sample's prompt was drawn at

Versions: SCHEMA_VERSION is the newest this ppoflow writes; every version in READABLE_VERSIONS is read. A shard
is stamped with the lowest version that describes it (version_of): single-turn shards are version 1, byte for
byte what they were before multi-turn existed; shards with the multi-turn columns are version 2, which an older
ppoflow refuses by name; shards with the curriculum column are version 3.
Bump SCHEMA_VERSION whenever a column is added, removed or changes type; readers refuse
a shard of another version with SchemaMismatchError instead of guessing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import pyarrow as pa

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MULTI_TURN_VERSION = 2  # the version that added the multi-turn columns
CURRICULUM_VERSION = 3  # the version that added curriculum_level
KINDS = ("rollout", "scored", "experience", "eval")

_I32, _F32 = pa.int32(), pa.float32()
_IDS, _FLOATS = pa.list_(pa.int32()), pa.list_(pa.float32())

_ROLLOUT = [
    pa.field("iteration", _I32, nullable=False),
    pa.field("prompt_index", _I32, nullable=False),
    pa.field("sample_index", _I32, nullable=False),
    pa.field("prompt_hash", pa.string(), nullable=False),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("response", pa.string(), nullable=False),
    pa.field("prompt_ids", _IDS, nullable=False),
    pa.field("response_ids", _IDS, nullable=False),
    pa.field("rollout_logprobs", _FLOATS, nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("policy_version", _I32, nullable=False),
    pa.field("label", pa.string(), nullable=True),
    pa.field("data_source", pa.string(), nullable=True),
]
_MULTI_TURN = [
    pa.field("token_owner", pa.list_(pa.int8()), nullable=False),
    pa.field("turn_starts", _IDS, nullable=False),
    pa.field("env_reward", _F32, nullable=False),
    pa.field("turns", _I32, nullable=False),
    pa.field("truncation", pa.string(), nullable=True),
    pa.field("env_info", pa.string(), nullable=False),
]
MULTI_TURN_COLUMNS = tuple(f.name for f in _MULTI_TURN)
_CURRICULUM = [pa.field("curriculum_level", _I32, nullable=False)]
CURRICULUM_COLUMN = "curriculum_level"
_SCORED_EXTRA = [
    pa.field("reward", _F32, nullable=False),
    pa.field("reward_components", pa.string(), nullable=False),
    pa.field("ref_logprobs", _FLOATS, nullable=False),
    pa.field("score_cache_hit", pa.bool_(), nullable=False),
]
_EXPERIENCE_EXTRA = [
    pa.field(name, _FLOATS, nullable=False) for name in ("old_logprobs", "values", "advantages", "returns")
]

SCHEMAS: dict[str, pa.Schema] = {
    "rollout": pa.schema(_ROLLOUT),
    "scored": pa.schema(_ROLLOUT + _SCORED_EXTRA),
    "experience": pa.schema(_ROLLOUT + _SCORED_EXTRA + _EXPERIENCE_EXTRA),
    "eval": pa.schema(_ROLLOUT + _SCORED_EXTRA),  # the eval stage's samples of held-out prompts, scored
}
# The same kinds with the optional columns (multi-turn, curriculum) after the rollout ones: (kind, mt, cur) -> schema.
_OPTIONAL_SCHEMAS: dict[tuple[str, bool, bool], pa.Schema] = {
    (kind, multi_turn, curriculum): pa.schema(
        _ROLLOUT
        + (_MULTI_TURN if multi_turn else [])
        + (_CURRICULUM if curriculum else [])
        + list(schema)[len(_ROLLOUT) :]
    )
    for kind, schema in SCHEMAS.items()
    for multi_turn in (False, True)
    for curriculum in (False, True)
}


class SchemaMismatchError(ValueError):
    """A table or shard does not match its kind's schema; the message names the column and both types."""


def schema_for(kind: str, multi_turn: bool = False, curriculum: bool = False) -> pa.Schema:
    """The Arrow schema of shard kind `kind`, with the multi-turn columns when `multi_turn` and curriculum_level
    when `curriculum`. Raises ValueError listing the kinds when unknown."""
    try:
        return _OPTIONAL_SCHEMAS[(kind, bool(multi_turn), bool(curriculum))]
    except KeyError:
        raise ValueError(f"unknown shard kind {kind!r}; expected one of {', '.join(KINDS)}") from None


def has_curriculum_level(schema: pa.Schema) -> bool:
    """True when `schema` (a table's) holds the curriculum_level column."""
    return CURRICULUM_COLUMN in schema.names


def is_multi_turn(schema: pa.Schema) -> bool:
    """True when `schema` (a table's) holds any multi-turn column: validate then asks for all of them."""
    return any(name in schema.names for name in MULTI_TURN_COLUMNS)


def schema_like(kind: str, table: pa.Table) -> pa.Schema:
    """`kind`'s schema with the multi-turn columns exactly when `table` has them (for appending stage columns)."""
    return schema_for(kind, is_multi_turn(table.schema), has_curriculum_level(table.schema))


def version_of(table: pa.Table) -> int:
    """The lowest schema version that describes `table`: 1 for single-turn rows, MULTI_TURN_VERSION with the
    multi-turn columns, CURRICULUM_VERSION with curriculum_level."""
    if has_curriculum_level(table.schema):
        return CURRICULUM_VERSION
    return MULTI_TURN_VERSION if is_multi_turn(table.schema) else 1


def validate(table: pa.Table, kind: str, where: str = "table") -> pa.Table:
    """Check `table` against `kind`'s schema; return it with the schema's column order and nullability.

    Every schema column must be present with exactly the schema's type (no silent int64 -> int32
    narrowing: build tables with `pa.table(data, schema=schema_for(kind))`), non-nullable columns must
    hold no nulls, and no other column may be present. Raises SchemaMismatchError naming `where`, the
    column, the expected and the found type.
    """
    schema = schema_like(kind, table)
    found = {f.name: f for f in table.schema}
    for field in schema:
        got = found.get(field.name)
        if got is None:
            raise SchemaMismatchError(
                f"{where}: {kind} column {field.name!r} is missing "
                f"(expected {field.type}); found columns: {', '.join(found) or 'none'}"
            )
        if got.type != field.type:
            raise SchemaMismatchError(
                f"{where}: {kind} column {field.name!r} has type {got.type}, expected {field.type}"
            )
        if not field.nullable and table.column(field.name).null_count:
            raise SchemaMismatchError(
                f"{where}: {kind} column {field.name!r} holds "
                f"{table.column(field.name).null_count} null(s) but is not nullable"
            )
    extra = [name for name in found if name not in schema.names]
    if extra:
        raise SchemaMismatchError(
            f"{where}: columns {extra} are not in the {kind} schema "
            f"(schema version {SCHEMA_VERSION}); add them to storage/schema.py first"
        )
    return table.select(schema.names).cast(schema)


def check_columns(kind: str, columns: Optional[Sequence[str]]) -> Optional[list[str]]:
    """Validate a column selection for `kind`; raises SchemaMismatchError naming unknown columns."""
    if columns is None:
        return None
    names = schema_for(kind, True, True).names  # optional columns are selectable (present in v2 / v3 shards)
    unknown = [c for c in columns if c not in names]
    if unknown:
        raise SchemaMismatchError(f"columns {unknown} are not in the {kind} schema; available: {', '.join(names)}")
    return list(columns)
