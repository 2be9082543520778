"""The score stage (stages.score.run_score, the Prefect task's body) on hand-made rollout shards, on a local
root and on the moto S3 root: retries compute nothing again, duplicates are computed once, new reward-model
weights miss, and a failing reward fails the stage naming the sample with no scored shard committed.

Real components throughout: the tiny Llama as reference, the tiny reward model, FunctionRewardSources from
a file (tests/unit/test_score_cache_logic.py's, which logs every call), storage's shards and ScoreCache.
Work is counted where it happens: the function's call log, the reward model's `samples_scored`, and a
forward hook on the reference model.
"""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pytest
from safetensors.torch import load_file, save_file

from engines.rewards.base import RewardError
from engines.toy.reward_model import build_tiny_reward_model
from ppoflow.config import build_config
from stages.held import scorer_for
from stages.manifests import RolloutManifest
from stages.score import run_score
from stages.tables import prompt_hash
from storage.fs import list_files
from storage.layout import RunLayout
from storage.schema import schema_for
from storage.shards import read_manifest, read_shards, write_shards
from tests.unit.test_score_cache_logic import TOKENIZER, count_reference_rows, samples_scored, write_reward_file

ITERATION = 1
# (prompt, label, four sampled responses). New (prompt, response) pairs by hand: 2 + 3 + 3 + 3 = 11
# ("3 3 3" under prompt 3 is another pair than under prompt 0: the prompt ids differ).
GROUPS = [
    ("say 3 :", "3", ["3 3 3", "3 3 3", "3 w4", "3 3 3"]),
    ("repeat 7 :", "7", ["7 7", "w5 7 7 w5", "7 7", "w9"]),
    ("write the digit 1 :", "1", ["1", "1 w13 1", "1 1 1 1", "1"]),  # w13: the failing functions' trigger
    ("copy number 3 :", "3", ["3 3 3", "3 3 3", "w4", "3 3 3 3 3 3 3 3"]),
]
ROWS, DISTINCT_PAIRS = 16, 11
FAILING_SAMPLE = f"iter {ITERATION} prompt 2 sample 1"


def rollout_table() -> pa.Table:
    """GROUPS as the rollout stage writes them (stages/tables.py): ids from the tokenizer, response text
    decoded from the response ids, the prompt hash of the prompt ids."""
    rows: dict[str, list] = {name: [] for name in schema_for("rollout").names}
    for prompt_index, (prompt, label, responses) in enumerate(GROUPS):
        prompt_ids = TOKENIZER(prompt)["input_ids"]
        for sample_index, response in enumerate(responses):
            response_ids = TOKENIZER(response, add_special_tokens=False)["input_ids"]
            values = {
                "iteration": ITERATION,
                "prompt_index": prompt_index,
                "sample_index": sample_index,
                "prompt_hash": prompt_hash(prompt_ids),
                "prompt": prompt,
                "response": TOKENIZER.decode(response_ids, skip_special_tokens=True),
                "prompt_ids": prompt_ids,
                "response_ids": response_ids,
                "rollout_logprobs": [-1.0] * len(response_ids),
                "finish_reason": "length",
                "policy_version": 0,
                "label": label,
                "data_source": "digits",
            }
            for name, value in values.items():
                rows[name].append(value)
    return pa.table(rows, schema=schema_for("rollout"))


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    return write_reward_file(tmp_path_factory.mktemp("rewards"))


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm", seed=0)


def stage_config(
    root: str,
    storage,
    model_dir,
    reward_file,
    reward_model_dir,
    length_function="length_reward",
    timeout_s: float = 60.0,
):
    """Three sources: the logged length function, the digits task's function, the tiny reward model."""
    return build_config(
        {
            "run": {"name": "score-stage", "root": root},
            "storage": storage.model_dump(),
            "model": {"policy_path": str(model_dir)},
            "train": {"micro_batch_size": 8},
            "reward": {
                "sources": [
                    {
                        "kind": "function",
                        "target": f"{reward_file}:{length_function}",
                        "name": "length",
                        "weight": 0.5,
                        "timeout_s": timeout_s,
                    },
                    {"kind": "function", "target": "engines.toy.task:reward_func", "name": "digits", "weight": 1.0},
                    {"kind": "model", "target": str(reward_model_dir), "name": "rm", "weight": 0.1, "batch_size": 8},
                ]
            },
        }
    )


def write_rollout(cfg) -> tuple[RunLayout, RolloutManifest]:
    layout = RunLayout(cfg.run.root, cfg.run.name, cfg.storage)
    stage_dir = layout.stage_dir(ITERATION, "rollout")
    manifest = write_shards(layout.fs, stage_dir, rollout_table(), "rollout")
    return layout, RolloutManifest(
        iteration=ITERATION,
        uri=layout.url(stage_dir),
        rows=manifest.rows,
        content_hash=manifest.content_hash,
        policy_version=0,
        engine="hand-made",
        seconds=0.0,
        worker="test:0",
        engine_builds=0,
    )


def work_counters(cfg, log):
    """(function samples, reward-model samples, reference rows list, hook) of the warm scorer for `cfg`."""
    scorer = scorer_for(cfg)
    rm = next(s for s in scorer.sources if s.name == "rm")
    rows, hook = count_reference_rows(scorer)
    return lambda: (samples_scored(log), rm.samples_scored, sum(rows)), hook


def test_the_rows_have_the_duplicates_counted_by_hand():
    table = rollout_table()
    pairs = {(tuple(p), tuple(r)) for p, r in zip(table["prompt_ids"].to_pylist(), table["response_ids"].to_pylist())}
    assert (table.num_rows, len(pairs)) == (ROWS, DISTINCT_PAIRS)


def test_the_warm_scorer_is_rebuilt_for_another_reference_batching(
    storage_root, tiny_model_dir, reward_file, reward_model_dir
):
    """The reference's micro-batch moves its log-probs by rounding: a run must not score with a scorer another run of
    the process built for its own micro-batch (the scores would depend on what ran before). Settings the score does
    not read keep the warm one."""
    root, storage = storage_root
    cfg = stage_config(root, storage, tiny_model_dir, reward_file[0], reward_model_dir)
    first = scorer_for(cfg)
    other_lr = cfg.model_copy(deep=True)
    other_lr.train.actor_lr = cfg.train.actor_lr * 2
    assert scorer_for(other_lr) is first
    wider = cfg.model_copy(deep=True)
    wider.train.micro_batch_size = 2 * cfg.train.micro_batch_size
    rebuilt = scorer_for(wider)
    assert rebuilt is not first and rebuilt.reference.micro_batch_size == 16 == 2 * first.reference.micro_batch_size


def test_a_retried_score_stage_computes_nothing_again(storage_root, tiny_model_dir, reward_file, reward_model_dir):
    root, storage = storage_root
    cfg = stage_config(root, storage, tiny_model_dir, reward_file[0], reward_model_dir)
    layout, rollout = write_rollout(cfg)
    work, hook = work_counters(cfg, reward_file[1])
    try:
        start = work()
        cold = run_score(cfg, ITERATION, rollout)
        after_cold = work()
        warm = run_score(cfg, ITERATION, rollout)  # the retry: new ScoreCache, segments read from storage
        after_warm = work()
    finally:
        hook.remove()
    # Cold: each distinct pair scored once by every source and by the reference.
    assert (cold.rows, cold.cache_hits, cold.cache_misses, cold.computed) == (ROWS, 0, ROWS, DISTINCT_PAIRS)
    assert [b - a for a, b in zip(start, after_cold)] == [DISTINCT_PAIRS] * 3
    # Retry: every row from the cache, no engine called.
    assert (warm.rows, warm.cache_hits, warm.cache_misses, warm.computed) == (ROWS, ROWS, 0, 0)
    assert after_warm == after_cold
    assert warm.scorer_identity == cold.scorer_identity
    cache_files = list_files(layout.fs, layout.score_cache_dir(cold.scorer_identity))
    assert len(cache_files) == 1 and next(iter(cache_files)).startswith("seg-")  # one batched put, on this root

    scored = read_shards(layout.fs, layout.stage_dir(ITERATION, "scored"))
    assert scored["score_cache_hit"].to_pylist() == [True] * ROWS
    first_columns = [n for n in scored.column_names if n != "score_cache_hit"]
    assert warm.content_hash != cold.content_hash  # only the hit flags differ...
    # ...the scores are the cold attempt's, bit for bit: recompute what the cold attempt wrote, cache off.
    uncached = build_config({**cfg.model_dump(mode="json"), "score": {"cache": False}})
    run_score(uncached, ITERATION, rollout)
    fresh = read_shards(layout.fs, layout.stage_dir(ITERATION, "scored"))
    assert fresh["score_cache_hit"].to_pylist() == [False] * ROWS
    assert scored.select(first_columns).equals(fresh.select(first_columns))
    for response, components in zip(scored["response"].to_pylist(), scored["reward_components"].to_pylist()):
        assert json.loads(components)["length"] == len(response.split())  # the logged function's own rule


def _edit_reward_model_weights(folder) -> None:
    """Shift the reward head's weights in place: same file name and size, other bytes."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    weights["score.weight"] = weights["score.weight"] + 0.5
    save_file(weights, path, metadata={"format": "pt"})


def test_new_reward_model_weights_change_the_identity_and_miss(tmp_path, tiny_model_dir, reward_file, reward_model_dir):
    from ppoflow.config import StorageConfig

    rm_copy = shutil.copytree(reward_model_dir, tmp_path / "rm")
    cfg = stage_config(str(tmp_path / "runs"), StorageConfig(), tiny_model_dir, reward_file[0], rm_copy)
    layout, rollout = write_rollout(cfg)
    before = run_score(cfg, ITERATION, rollout)
    old_scores = read_shards(layout.fs, layout.stage_dir(ITERATION, "scored"))["reward_components"].to_pylist()
    _edit_reward_model_weights(rm_copy)
    after = run_score(cfg, ITERATION, rollout)  # same config, same path: only the weights changed
    assert after.scorer_identity != before.scorer_identity
    old_dir, new_dir = (layout.score_cache_dir(r.scorer_identity) for r in (before, after))
    assert old_dir != new_dir
    assert (after.cache_hits, after.computed) == (0, DISTINCT_PAIRS)
    assert len(list_files(layout.fs, old_dir)) == 1 and len(list_files(layout.fs, new_dir)) == 1
    new_scores = read_shards(layout.fs, layout.stage_dir(ITERATION, "scored"))["reward_components"].to_pylist()
    old_rm = [json.loads(c)["rm"] for c in old_scores]
    new_rm = [json.loads(c)["rm"] for c in new_scores]
    # The new head really scored: a +0.5 shift of every head weight moves each score by 0.5 * sum(hidden
    # state), which is nowhere near 0 for these random weights (its size was ~1e-1 or more when checked).
    assert all(abs(a - b) > 1e-3 for a, b in zip(old_rm, new_rm))
    assert [json.loads(c)["length"] for c in new_scores] == [json.loads(c)["length"] for c in old_scores]


@pytest.mark.parametrize(
    "function, message",
    [("failing_score", "raised ValueError: cannot score the word w13"), ("hanging_score", "timed out after 0.5 s")],
)
def test_a_failing_reward_fails_the_stage_and_commits_no_scored_shard(
    storage_root, tiny_model_dir, reward_file, reward_model_dir, function, message
):
    root, storage = storage_root
    good = stage_config(root, storage, tiny_model_dir, reward_file[0], reward_model_dir)
    bad = stage_config(
        root, storage, tiny_model_dir, reward_file[0], reward_model_dir, length_function=function, timeout_s=0.5
    )
    layout, rollout = write_rollout(good)
    scored_dir = layout.stage_dir(ITERATION, "scored")
    committed = run_score(good, ITERATION, rollout)  # an earlier attempt (other settings) committed
    assert read_manifest(layout.fs, scored_dir) is not None

    with pytest.raises(RewardError, match=f"{message} on {FAILING_SAMPLE}"):
        run_score(bad, ITERATION, rollout)
    # Decision (stages/score.py): the folder is uncommitted before scoring, so the failed attempt leaves
    # neither the earlier attempt's output nor a mix of both: no manifest and no part at all.
    assert read_manifest(layout.fs, scored_dir) is None
    assert list_files(layout.fs, scored_dir) == {}
    assert read_manifest(layout.fs, layout.stage_dir(ITERATION, "rollout")) is not None  # input untouched
    bad_identity = scorer_for(bad).identity
    assert list_files(layout.fs, layout.score_cache_dir(bad_identity)) == {}  # nothing cached for the failure

    # The retry with working settings recommits, from the cache of the first attempt.
    retried = run_score(good, ITERATION, rollout)
    assert (retried.cache_hits, retried.computed) == (ROWS, 0)
    assert retried.scorer_identity == committed.scorer_identity
    assert read_manifest(layout.fs, scored_dir).rows == ROWS
