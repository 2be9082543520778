"""Which rows each update rank holds (rank_rows, step_share), how its rows are padded to the whole batch's widths
(pad_to), and how a rank reads only the shard parts that hold its rows (update_ranks.read_rank_rows)."""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pytest
import torch

from engines.trainer.experience import ExperienceBatch
from engines.trainer.rank_rows import agree_shape, gather_rows, pad_to, rank_rows, step_share
from stages.update_ranks import read_rank_rows
from storage.shards import ShardCorruptError, read_shards, write_shards
from storage.synthetic import synthetic_table


class TestRankRows:
    @pytest.mark.parametrize("total, world", [(16, 1), (16, 2), (16, 4), (12, 3), (8, 8)])
    def test_the_ranks_hold_disjoint_contiguous_blocks_that_cover_the_batch_in_order(self, total, world):
        blocks = [rank_rows(total, rank, world) for rank in range(world)]
        assert [i for start, stop in blocks for i in range(start, stop)] == list(range(total))
        assert {stop - start for start, stop in blocks} == {total // world}

    def test_a_batch_the_ranks_cannot_share_evenly_is_refused_naming_both(self):
        with pytest.raises(ValueError, match=r"batch of 10 rows cannot be split evenly over train.num_ranks=4"):
            rank_rows(10, 0, 4)
        with pytest.raises(ValueError, match="rank 2 is not a rank of a world of 2"):
            rank_rows(8, 2, 2)


class TestStepShare:
    def test_the_shares_of_a_shuffled_step_partition_it_in_order(self):
        step = torch.randperm(12, generator=torch.Generator().manual_seed(0))
        for world in (1, 2, 3, 4):
            shares = [step_share(step, rank, world) for rank in range(world)]
            assert torch.equal(torch.cat(shares), step)  # every row of the step trained exactly once
            assert {len(s) for s in shares} == {12 // world}

    def test_a_step_the_ranks_cannot_share_evenly_is_refused(self):
        with pytest.raises(ValueError, match=r"step of 6 rows cannot be shared by train.num_ranks=4"):
            step_share(torch.arange(6), 0, 4)

    def test_the_unshuffled_single_step_gives_each_rank_its_own_rows(self):
        # what lets a rank reuse its first forward (PPOTrainer._first_forward) in epoch 0
        whole = torch.arange(16)
        for rank in range(4):
            start, stop = rank_rows(16, rank, 4)
            assert step_share(whole, rank, 4).tolist() == list(range(start, stop))


def _lists():
    """Five rows: ragged prompts and responses (the widest prompt in row 3, the widest response in row 0)."""
    prompts = [[1, 5], [1], [1, 6], [1, 7, 8, 9], [2]]
    responses = [[10, 11, 12, 13], [14], [15, 16], [17], [18, 19]]
    ref = [[-0.5 - t for t in range(len(r))] for r in responses]
    rollout = [[-0.25 - t for t in range(len(r))] for r in responses]
    return prompts, responses, [0.1, 0.2, 0.3, 0.4, 0.5], ref, rollout


def _batch(rows: list[int], pad: int) -> ExperienceBatch:
    prompts, responses, scores, ref, rollout = _lists()
    pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
    return ExperienceBatch.from_lists(
        pick(prompts),
        pick(responses),
        pick(scores),
        pick(ref),
        rollout_logprobs=pick(rollout),
        group_ids=rows,
        pad_token_id=pad,
        finish_reasons=pick(["stop", "length", "stop", "stop", "length"]),
        # multi-turn owners (1 = policy, 0 = environment): the policy mask is padded like every per-token field
        token_owner=pick([[1, 0, 0, 1], [1], [1, 1], [1], [1, 0]]),
    )


def _assert_same(a: ExperienceBatch, b: ExperienceBatch) -> None:
    for name in vars(a):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


class TestPadTo:
    def test_a_ranks_rows_padded_to_the_whole_widths_equal_those_rows_of_the_whole_batch(self):
        # second implementation: from_lists pads the whole batch itself; rows 1-2 alone are 2 + 2 wide, the whole 4 + 4
        whole = _batch([0, 1, 2, 3, 4], pad=3)
        own = _batch([1, 2], pad=3)
        assert (own.prompt_ids.shape[1], own.response_ids.shape[1]) == (2, 2)
        padded = pad_to(own, 4, 4, pad_token_id=3)
        _assert_same(padded, whole.select(torch.tensor([1, 2])))
        # by hand: row 1 is prompt [1] left-padded, response [14] right-padded with ids 3 and masks 0
        assert padded.prompt_ids[0].tolist() == [3, 3, 3, 1] and padded.prompt_mask[0].tolist() == [0, 0, 0, 1]
        assert padded.response_ids[0].tolist() == [14, 3, 3, 3] and padded.response_mask[0].tolist() == [1, 0, 0, 0]

    def test_world_of_one_is_the_batch_itself(self):
        own = _batch([0, 1, 2, 3, 4], pad=0)
        assert agree_shape(own, 1) == (5, 4, 4)
        old = torch.zeros(5, 4)
        batch, logprobs, values = gather_rows(own, old, None, 1)
        assert batch is own and logprobs is old and values is None
        assert pad_to(own, 4, 4, 0) is own

    def test_a_wider_batch_cannot_be_narrowed(self):
        with pytest.raises(ValueError, match=r"cannot pad a batch of widths \(4, 4\) to \(3, 4\)"):
            pad_to(_batch([0, 1, 2, 3, 4], pad=0), 3, 4, 0)


@pytest.fixture()
def scored_dir(tmp_path):
    """10 scored rows in parts of 3, 3, 2 and 2 rows (write_shards balances the parts)."""
    fs = fsspec.filesystem("file")
    table = synthetic_table("scored", 10, seed=1, prompt_len=4, response_len=4, vocab=64, group_size=2)
    manifest = write_shards(fs, str(tmp_path / "scored"), table, "scored", max_rows=3)
    assert [p.rows for p in manifest.parts] == [3, 3, 2, 2]
    return fs, str(tmp_path / "scored"), table, manifest


class TestReadRankRows:
    @pytest.mark.parametrize("world", [1, 2, 5, 10])
    def test_each_rank_reads_its_block_and_the_blocks_make_the_table(self, scored_dir, world):
        fs, stage_dir, table, _ = scored_dir
        blocks = [read_rank_rows(fs, stage_dir, rank, world, 10) for rank in range(world)]
        assert all(b.num_rows == 10 // world for b in blocks)
        assert pa.concat_tables(blocks).equals(read_shards(fs, stage_dir)) and pa.concat_tables(blocks).equals(table)

    def test_only_the_parts_holding_the_ranks_rows_are_read(self, scored_dir):
        # rows 0-4 (rank 0 of 2) lie in parts 0 and 1, rows 5-9 (rank 1) in parts 1, 2 (rows 6-7) and 3: a corrupt
        # part 2 fails rank 1 (naming it) and is never opened by rank 0
        fs, stage_dir, table, manifest = scored_dir
        with fs.open(f"{stage_dir}/{manifest.parts[2].name}", "r+b") as f:
            f.seek(100)
            f.write(b"\xff\xff\xff\xff")
        assert read_rank_rows(fs, stage_dir, 0, 2, 10).equals(table.slice(0, 5))
        with pytest.raises(ShardCorruptError, match=manifest.parts[2].name):
            read_rank_rows(fs, stage_dir, 1, 2, 10)

    def test_another_row_count_than_rank_0_read_is_refused(self, scored_dir):
        fs, stage_dir, _, _ = scored_dir
        with pytest.raises(ValueError, match=r"hold 10 rows, rank 0 expects 12"):
            read_rank_rows(fs, stage_dir, 1, 2, 12)
