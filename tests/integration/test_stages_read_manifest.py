"""Stage bodies read the shards their hand-off names, at its uri, and only if they have its content hash.

The real stages on the tiny model (HF rollout, the toy config's scorer, DeepSpeed on CPU): a rollout folder, or a
scored folder, rewritten with storage's own writer after its manifest was handed on (valid shards, another hash)
is refused by the stage it is handed to, naming the stage, the iteration, the folder and both hashes, before the
stage writes anything; a hand-off that names another folder (rows copied elsewhere, fewer and changed) is read
there, and the stage's output rows are that folder's rows, not the run's own. The same for the rollout merge and
its parts' hand-offs.

Expectations come from the tables the test writes itself: the hashes storage's writer returned for them, and
the rows themselves.
"""

from __future__ import annotations

import hashlib
import os

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from ppoflow.config import ConfigError
from stages import update_ranks
from stages.handed import HandedShardsError
from stages.policy import policy_ref
from stages.rollout import run_rollout
from stages.rollout_parts import merge_rollout_parts, run_rollout_part
from stages.score import run_score
from stages.update import run_update
from storage.layout import layout_for
from storage.schema import schema_for
from storage.shards import read_shards, write_shards
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

ITERATION = 1


def _config(root, name, tiny_model_dir, digits_dataset_dir):
    # no score cache: a refused stage must leave no trace anywhere, and a cache shared across tests would hide work
    return small_config(str(root), name, tiny_model_dir, digits_dataset_dir, iterations=1, score={"cache": False})


def _files(folder) -> dict[str, str]:
    """{path under `folder`: sha256 of its bytes} of every file: what a refused stage must leave as it was."""
    found = {}
    for where, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(where, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def _tampered(table: pa.Table, column: str, value) -> pa.Table:
    """`table` with row 0's `column` set to `value`: one changed row, the same schema."""
    values = table.column(column).to_pylist()
    assert values[0] != value
    values[0] = value
    index = table.schema.get_field_index(column)
    return table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))


def _rewrite(layout, stage: str, table: pa.Table) -> str:
    """Rewrite iteration 1's `stage` folder with storage's own writer; the new shard manifest's content hash."""
    return write_shards(layout.fs, layout.stage_dir(ITERATION, stage), table, stage).content_hash


def _other_rows(table: pa.Table, groups: int, n: int) -> pa.Table:
    """The last `groups` groups of `n` samples of `table`, last group first, every response text changed: rows the
    run's own folder does not hold (a group stays whole and in sample order: the update's group baselines)."""
    first = table.num_rows // n - groups
    order = [g * n + s for g in reversed(range(first, first + groups)) for s in range(n)]
    rows = table.take(order)
    index = rows.schema.get_field_index("response")
    changed = pc.binary_join_element_wise(rows.column("response"), " (copied)", "")
    return rows.set_column(index, rows.schema.field(index), changed)


def _refusal_names(error: HandedShardsError, stage: str, folder: str, expected: str, found: str) -> None:
    message = str(error)
    assert f"{stage} stage of iteration {ITERATION}" in message
    assert folder in message and expected in message and found in message
    assert expected != found


@pytest.fixture()
def rollout_run(tmp_path, tiny_model_dir, digits_dataset_dir):
    """(config, layout, the rollout manifest) of a run whose iteration 1 was sampled by the real rollout stage."""
    cfg = _config(tmp_path / "runs", "handed", tiny_model_dir, digits_dataset_dir)
    return cfg, layout_for(cfg), run_rollout(cfg, ITERATION, policy_ref(cfg, ITERATION))


def test_score_refuses_rollout_shards_rewritten_after_their_manifest(rollout_run):
    cfg, layout, rollout = rollout_run
    rows = read_shards(layout.fs, layout.stage_dir(ITERATION, "rollout"))
    rewritten = _rewrite(layout, "rollout", _tampered(rows, "response", "tampered by hand"))
    before = _files(layout.run_dir)
    with pytest.raises(HandedShardsError) as refused:
        run_score(cfg, ITERATION, rollout)
    _refusal_names(refused.value, "score", rollout.uri, rollout.content_hash, rewritten)
    assert _files(layout.run_dir) == before  # nothing written, nothing committed: no scored folder at all
    assert not layout.fs.exists(layout.stage_dir(ITERATION, "scored"))


def test_score_refuses_a_folder_that_is_gone(rollout_run):
    cfg, layout, rollout = rollout_run
    layout.fs.rm(layout.stage_dir(ITERATION, "rollout"), recursive=True)
    with pytest.raises(HandedShardsError, match="no committed shards are there") as refused:
        run_score(cfg, ITERATION, rollout)
    assert rollout.uri in str(refused.value) and rollout.content_hash in str(refused.value)
    assert not layout.fs.exists(layout.stage_dir(ITERATION, "scored"))


def test_score_reads_the_folder_its_manifest_names(rollout_run, tmp_path):
    cfg, layout, rollout = rollout_run
    own = read_shards(layout.fs, layout.stage_dir(ITERATION, "rollout"))
    copy = _other_rows(own, groups=2, n=cfg.rollout.n_samples)
    elsewhere = str(tmp_path / "elsewhere" / "rollout")
    written = write_shards(layout.fs, elsewhere, copy, "rollout")
    handed = rollout.model_copy(update={"uri": elsewhere, "rows": written.rows, "content_hash": written.content_hash})
    scored = run_score(cfg, ITERATION, handed)
    rows = read_shards(layout.fs, layout.stage_dir(ITERATION, "scored"))
    assert scored.rows == rows.num_rows == copy.num_rows == 2 * cfg.rollout.n_samples < own.num_rows
    assert rows.select(schema_for("rollout").names).equals(copy)  # the copy's rows, row for row, not the run's
    assert read_shards(layout.fs, layout.stage_dir(ITERATION, "rollout")).equals(own)  # its own folder untouched


@pytest.fixture()
def scored_run(rollout_run):
    """rollout_run plus the real score stage's manifest of iteration 1."""
    cfg, layout, rollout = rollout_run
    return cfg, layout, run_score(cfg, ITERATION, rollout)


def test_update_refuses_scored_shards_rewritten_after_their_manifest(scored_run):
    cfg, layout, scored = scored_run
    rows = read_shards(layout.fs, layout.stage_dir(ITERATION, "scored"))
    rewritten = _rewrite(layout, "scored", _tampered(rows, "reward", rows.column("reward")[0].as_py() + 1.0))
    before = _files(layout.run_dir)
    with pytest.raises(HandedShardsError) as refused:
        run_update(cfg, ITERATION, policy_ref(cfg, ITERATION), scored)
    _refusal_names(refused.value, "update", scored.uri, scored.content_hash, rewritten)
    assert _files(layout.run_dir) == before  # no experience shards, no staged checkpoint
    assert not layout.fs.exists(layout.stage_dir(ITERATION, "experience"))

    # train.num_ranks = 2 in a process that no torchrun started: refused by name, before anything is read or written
    two_ranks = cfg.model_copy(update={"train": cfg.train.model_copy(update={"num_ranks": 2})})
    with pytest.raises(ConfigError, match=r"train.num_ranks=2: .*torchrun --nproc-per-node=2 --no-python ppoflow"):
        run_update(two_ranks, ITERATION, policy_ref(cfg, ITERATION), scored)
    assert _files(layout.run_dir) == before
    # a rank told to train on it (the folder rewritten after rank 0 checked it) refuses too, before it trains
    rank = update_ranks._Rank()
    rank.cfg = two_ranks  # what the group's build command sets; no trainer needed to refuse
    with pytest.raises(HandedShardsError) as refused:
        rank({"op": "update", "iteration": ITERATION, "scored": scored.model_dump(mode="json")})
    _refusal_names(refused.value, "update", scored.uri, scored.content_hash, rewritten)


def test_update_trains_on_the_folder_its_manifest_names(scored_run, tmp_path):
    cfg, layout, scored = scored_run
    own = read_shards(layout.fs, layout.stage_dir(ITERATION, "scored"))
    # every group (the update takes whole train batches: train.train_batch_size is the iteration's rows), reordered
    copy = _other_rows(own, groups=own.num_rows // cfg.rollout.n_samples, n=cfg.rollout.n_samples)
    elsewhere = str(tmp_path / "elsewhere" / "scored")
    written = write_shards(layout.fs, elsewhere, copy, "scored")
    handed = scored.model_copy(update={"uri": elsewhere, "rows": written.rows, "content_hash": written.content_hash})
    run_update(cfg, ITERATION, policy_ref(cfg, ITERATION), handed)
    # the experience shards carry every scored column of the rows the update trained on
    experience = read_shards(layout.fs, layout.stage_dir(ITERATION, "experience"))
    assert experience.select(schema_for("scored").names).equals(copy)
    assert not copy.equals(own) and copy.num_rows == own.num_rows


def test_the_rollout_merge_refuses_a_rewritten_part_and_reads_each_part_where_it_is(rollout_run, tmp_path):
    cfg, layout, _ = rollout_run
    policy = policy_ref(cfg, ITERATION)
    parts = [run_rollout_part(cfg, ITERATION, policy, part, 2) for part in (0, 1)]
    own = [read_shards(layout.fs, p.uri) for p in parts]
    merged_dir = layout.stage_dir(ITERATION, "rollout")
    before = read_shards(layout.fs, merged_dir)  # the unsplit rollout of the fixture: the merge must not touch it

    rewritten = write_shards(layout.fs, parts[1].uri, _tampered(own[1], "response", "tampered by hand"), "rollout")
    with pytest.raises(HandedShardsError) as refused:
        merge_rollout_parts(cfg, ITERATION, parts)
    _refusal_names(refused.value, "rollout merge", parts[1].uri, parts[1].content_hash, rewritten.content_hash)
    assert read_shards(layout.fs, merged_dir).equals(before)

    copy = _other_rows(own[1], groups=1, n=cfg.rollout.n_samples)  # one group of part 1, changed
    elsewhere = str(tmp_path / "elsewhere" / "part-1")
    written = write_shards(layout.fs, elsewhere, copy, "rollout")
    moved = parts[1].model_copy(update={"uri": elsewhere, "rows": written.rows, "content_hash": written.content_hash})
    merged = merge_rollout_parts(cfg, ITERATION, [parts[0], moved])
    assert merged.rows == own[0].num_rows + copy.num_rows
    assert read_shards(layout.fs, merged_dir).equals(pa.concat_tables([own[0], copy]))


def test_a_run_moved_after_its_rollout_is_scored_where_it_is_now(rollout_run, tmp_path):
    # The README's promise: a run moved to another root finds its completed stages again. The rollout's persisted
    # hand-off still names the old folder; the run's own folder at its new root has the same content hash, so
    # score reads it there. A moved copy with other rows is still refused, naming the old place.
    import shutil

    cfg, layout, rollout = rollout_run
    own = read_shards(layout.fs, layout.stage_dir(ITERATION, "rollout"))
    new_root = tmp_path / "moved"
    shutil.copytree(layout.url(layout.run_dir), new_root / cfg.run.name)
    shutil.rmtree(layout.url(layout.run_dir))
    moved = cfg.model_copy(update={"run": cfg.run.model_copy(update={"root": str(new_root)})})
    there = layout_for(moved)
    assert not os.path.exists(rollout.uri) and there.url(there.stage_dir(ITERATION, "rollout")) != rollout.uri
    scored = run_score(moved, ITERATION, rollout)
    rows = read_shards(there.fs, there.stage_dir(ITERATION, "scored"))
    assert scored.rows == rows.num_rows == own.num_rows
    assert rows.select(schema_for("rollout").names).equals(own)
    rewritten = _rewrite(there, "rollout", _tampered(own, "response", "tampered after the move"))
    with pytest.raises(HandedShardsError, match="no committed shards are there") as refused:
        run_score(moved, ITERATION, rollout)
    assert rollout.uri in str(refused.value) and rewritten not in str(refused.value)
