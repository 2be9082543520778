"""The one codec between what the engines produce and the Arrow rows of the shards (storage/schema.py).

    rollout_table(records, samples, tokenizer, iteration)   prompts + samples        -> rollout rows
    scoring_inputs(rollout rows)                            rollout rows             -> ScoringInput per row
    scored_table(rollout rows, results, hit_mask)           + rewards, ref log-probs -> scored rows
    experience_batch(scored rows, pad_token_id)             scored rows              -> padded tensors
    experience_table(scored rows, update result)            + old log-probs, values, advantages, returns
    write_stage_table(cfg, layout, iteration, kind, rows)    the rows as the iteration's shards of that kind
                                                            (or, with folder=, a rollout part's shards)

The pipeline writes these tables to shards between stages; the bare loop (stages/loop.py) passes them
in memory. Both go through these functions, so a row means the same thing on either path.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional, Sequence

import pyarrow as pa

from engines.data import PromptRecord
from engines.rollout.base import RolloutSample
from engines.rollout.multi_turn import ConversationSample
from engines.scoring.scorer import ScoreResult, ScoringInput
from engines.trainer.experience import ExperienceBatch
from storage.layout import RunLayout
from storage.schema import schema_for, schema_like
from storage.shards import Manifest, shard_metadata, write_shards

_F32_LIST = pa.list_(pa.float32())


def prompt_hash(prompt_ids: Sequence[int]) -> str:
    """sha256 hex of the prompt's token ids (the shards' `prompt_hash` column)."""
    return hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()


def rollout_table(records: list[PromptRecord], samples: list[RolloutSample], tokenizer, iteration: int) -> pa.Table:
    """One row per sample, in the samples' order; `records[s.prompt_index]` is the sample's prompt.

    The response text is decoded without special tokens (EOS, pad): what a reward function reads. Conversations
    (ConversationSample, engines/rollout/multi_turn.py) give multi-turn rows (storage/schema.py): their prompt is
    the first user message as rendered (the environment's own when its reset gave one), their response every
    token after it, and the ownership, turn and environment columns.
    """
    multi_turn = any(isinstance(s, ConversationSample) for s in samples)
    schema = schema_for("rollout", multi_turn)
    rows: dict[str, list] = {name: [] for name in schema.names}
    for s in samples:
        record = records[s.prompt_index]
        rows["iteration"].append(iteration)
        rows["prompt_index"].append(record.index)
        rows["sample_index"].append(s.sample_index)
        rows["prompt_hash"].append(prompt_hash(s.prompt_ids))
        rows["prompt"].append(s.prompt_text if multi_turn else record.text)
        rows["response"].append(tokenizer.decode(s.response_ids, skip_special_tokens=True))
        rows["prompt_ids"].append(list(s.prompt_ids))
        rows["response_ids"].append(list(s.response_ids))
        rows["rollout_logprobs"].append([float(x) for x in s.rollout_logprobs])
        rows["finish_reason"].append(s.finish_reason)
        rows["policy_version"].append(s.policy_version)
        rows["label"].append(None if record.label is None else str(record.label))
        rows["data_source"].append(record.data_source)
        if multi_turn:
            rows["token_owner"].append(list(s.token_owner))
            rows["turn_starts"].append(list(s.turn_starts))
            rows["env_reward"].append(float(s.env_reward))
            rows["turns"].append(s.turns)
            rows["truncation"].append(s.truncation)
            rows["env_info"].append(json.dumps(s.env_info, sort_keys=True))
    return pa.table(rows, schema=schema)


def scoring_inputs(table: pa.Table) -> list[ScoringInput]:
    """One ScoringInput per rollout row; `sample_id` ("iter 3 prompt 12 sample 1") is how errors name it."""
    cols = table.to_pydict()
    return [
        ScoringInput(
            prompt=cols["prompt"][i],
            response=cols["response"][i],
            prompt_ids=cols["prompt_ids"][i],
            response_ids=cols["response_ids"][i],
            label=cols["label"][i],
            data_source=cols["data_source"][i],
            env_reward=cols["env_reward"][i] if "env_reward" in cols else None,
            sample_id=f"iter {cols['iteration'][i]} prompt {cols['prompt_index'][i]} sample {cols['sample_index'][i]}",
        )
        for i in range(table.num_rows)
    ]


def scored_table(table: pa.Table, results: list[ScoreResult], hit_mask: Sequence[bool]) -> pa.Table:
    """Rollout rows + reward, reward_components (JSON), ref_logprobs and score_cache_hit, row for row."""
    if len(results) != table.num_rows or len(hit_mask) != table.num_rows:
        raise ValueError(f"{table.num_rows} rollout rows but {len(results)} score results, {len(hit_mask)} flags")
    return (
        table.append_column("reward", pa.array([r.reward for r in results], pa.float32()))
        .append_column("reward_components", pa.array([json.dumps(r.components, sort_keys=True) for r in results]))
        .append_column("ref_logprobs", pa.array([r.ref_logprobs for r in results], _F32_LIST))
        .append_column("score_cache_hit", pa.array(list(hit_mask), pa.bool_()))
    ).cast(schema_like("scored", table))


def group_ids_of(sample_index: Sequence[int]) -> list[int]:
    """Group id of each row, from the rows' `sample_index` column: a group is one draw of a prompt, its n
    samples in order 0..n-1, so a row with sample_index 0 opens the next group.

    Not the dataset row (`prompt_index`): an iteration that crosses an epoch boundary of the prompt stream,
    or a dynamic-sampling round that draws a prompt again, holds the same dataset row twice, as two groups.
    ValueError naming the row when the samples are not in group order (0, 1, .., then 0 again)."""
    ids: list[int] = []
    for row, s in enumerate(sample_index):
        if s == 0:
            ids.append(ids[-1] + 1 if ids else 0)
        elif row > 0 and s == sample_index[row - 1] + 1:
            ids.append(ids[-1])
        else:
            previous = sample_index[row - 1] if row > 0 else None
            raise ValueError(
                f"row {row}: sample_index {s} after {previous}; rows must come group by group, samples 0..n-1"
            )
    return ids


def experience_batch(scored: pa.Table, pad_token_id: int) -> ExperienceBatch:
    """Scored rows -> padded tensors; the samples of one draw of a prompt (contiguous in the shards) form
    one group (group_ids_of). Multi-turn rows carry their `token_owner` as the batch's policy_mask."""
    cols = scored.to_pydict()
    return ExperienceBatch.from_lists(
        cols["prompt_ids"],
        cols["response_ids"],
        cols["reward"],
        cols["ref_logprobs"],
        rollout_logprobs=cols["rollout_logprobs"],
        group_ids=group_ids_of(cols["sample_index"]),
        finish_reasons=cols["finish_reason"],
        pad_token_id=pad_token_id,
        token_owner=cols.get("token_owner"),
    )


def experience_table(scored: pa.Table, result) -> pa.Table:
    """Scored rows + the update's per-token old_logprobs, values, advantages and returns (UpdateResult)."""
    return (
        scored.append_column("old_logprobs", pa.array(result.old_logprobs, _F32_LIST))
        .append_column("values", pa.array(result.values, _F32_LIST))
        .append_column("advantages", pa.array(result.advantages, _F32_LIST))
        .append_column("returns", pa.array(result.returns, _F32_LIST))
    ).cast(schema_like("experience", scored))


def write_stage_table(
    cfg, layout: RunLayout, iteration: int, kind: str, table: pa.Table, folder: Optional[str] = None
) -> Manifest:
    """Write `table` as iteration `iteration`'s `kind` shards (rollout, scored, experience), replacing what the
    folder held (manifest last); every part's schema metadata names the run, iteration, stage and config.
    folder: another folder than the iteration's `kind` folder (a rollout part's own, stages/rollout.py)."""
    return write_shards(
        layout.fs,
        folder or layout.stage_dir(iteration, kind),
        table,
        kind,
        max_rows=cfg.storage.shard_max_rows,
        max_bytes=cfg.storage.shard_max_bytes,
        metadata={**_carried(table), **shard_metadata(cfg, iteration, kind)},
    )


_CARRIED = (b"ppoflow.env_failures",)  # a stage's own accounting of rows it left out (stages/env_failures.py)


def _carried(table: pa.Table) -> dict[str, str]:
    """The table's schema metadata under the _CARRIED keys, kept in its shards (the others are the writer's)."""
    metadata = table.schema.metadata or {}
    return {key.decode(): metadata[key].decode() for key in _CARRIED if key in metadata}
