"""Synthetic shard tables with realistic shapes, for tests and bench/shards.py (never for training).

Token ids are random in [0, vocab); per-token float columns have the response's length, as the real
stages write them. Deterministic for a given seed.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa

from storage.schema import schema_for


def _ragged(lengths: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type))


def synthetic_table(
    kind: str,
    num_rows: int,
    seed: int = 0,
    prompt_len: int = 64,
    response_len: int = 128,
    vocab: int = 32000,
    iteration: int = 1,
    group_size: int = 4,
) -> pa.Table:
    """A `kind` table of `num_rows` samples; lengths vary uniformly in [1, prompt_len] / [1, response_len].

    Samples come in groups of `group_size` sharing a prompt (as with rollout.n_samples).
    """
    rng = np.random.default_rng(seed)
    prompt_index = (np.arange(num_rows) // group_size).astype(np.int32)
    n_prompts = int(prompt_index.max()) + 1 if num_rows else 0
    prompt_lengths_by_prompt = rng.integers(1, prompt_len + 1, size=n_prompts)
    prompt_tokens = [rng.integers(0, vocab, size=n).astype(np.int32) for n in prompt_lengths_by_prompt]
    p_lens = prompt_lengths_by_prompt[prompt_index] if num_rows else np.zeros(0, dtype=np.int64)
    r_lens = rng.integers(1, response_len + 1, size=num_rows)
    p_values = np.concatenate([prompt_tokens[i] for i in prompt_index]) if num_rows else np.zeros(0, np.int32)
    r_total = int(r_lens.sum())
    hashes = [hashlib.sha256(t.tobytes()).hexdigest() for t in prompt_tokens]
    columns = {
        "iteration": pa.array(np.full(num_rows, iteration, np.int32)),
        "prompt_index": pa.array(prompt_index),
        "sample_index": pa.array((np.arange(num_rows) % group_size).astype(np.int32)),
        "prompt_hash": pa.array([hashes[i] for i in prompt_index], pa.string()),
        "prompt": pa.array([f"prompt {i}" for i in prompt_index], pa.string()),
        "response": pa.array([f"response {i}" for i in range(num_rows)], pa.string()),
        "prompt_ids": _ragged(p_lens, p_values, pa.int32()),
        "response_ids": _ragged(r_lens, rng.integers(0, vocab, size=r_total).astype(np.int32), pa.int32()),
        "rollout_logprobs": _ragged(r_lens, -rng.exponential(1.0, r_total).astype(np.float32), pa.float32()),
        "finish_reason": pa.array(np.where(r_lens == response_len, "length", "stop").tolist(), pa.string()),
        "policy_version": pa.array(np.full(num_rows, max(iteration - 1, 0), np.int32)),
        "label": pa.array([str(i % 10) for i in prompt_index], pa.string()),
        "data_source": pa.array(["synthetic"] * num_rows, pa.string()),
    }
    if kind in ("scored", "experience"):
        reward = rng.normal(0.0, 1.0, num_rows).astype(np.float32)
        columns["reward"] = pa.array(reward)
        columns["reward_components"] = pa.array([json.dumps({"function": float(r)}) for r in reward], pa.string())
        columns["ref_logprobs"] = _ragged(r_lens, -rng.exponential(1.0, r_total).astype(np.float32), pa.float32())
        columns["score_cache_hit"] = pa.array(rng.random(num_rows) < 0.5)
    if kind == "experience":
        for name in ("old_logprobs", "values", "advantages", "returns"):
            columns[name] = _ragged(r_lens, rng.normal(0, 1, r_total).astype(np.float32), pa.float32())
    schema = schema_for(kind)
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)
