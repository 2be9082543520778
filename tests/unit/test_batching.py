"""token_budget_batches: hand-checked cases plus properties (partition, budget, padding saved)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.scoring.batching import padded_tokens, token_budget_batches


def fixed_size_batches(n: int, size: int) -> list[list[int]]:
    """The baseline: rows in arrival order, `size` rows per batch (what a plain DataLoader does)."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


class TestTokenBudgetBatchesByHand:
    def test_groups_longest_first_within_budget(self):
        # lengths 3, 9, 4, 8 with budget 16: descending order is rows 1 (9), 3 (8), 2 (4), 0 (3).
        # [1, 3] would pad to 2 * 9 = 18 > 16, so row 1 stands alone; [3, 2] pads to 2 * 8 = 16 <= 16;
        # adding row 0 gives 3 * 8 = 24 > 16, so row 0 starts the last batch.
        assert token_budget_batches([3, 9, 4, 8], 16) == [[1], [3, 2], [0]]

    def test_row_longer_than_budget_gets_its_own_batch(self):
        # Row 0 (length 50) exceeds the budget 10; rows 1 and 2 pad to 2 * 5 = 10 <= 10.
        assert token_budget_batches([50, 5, 5], 10) == [[0], [1, 2]]

    def test_ties_keep_index_order_and_row_cap_applies(self):
        # Four rows of length 2 fit 4 * 2 = 8 <= 100, but max_batch_rows=3 caps the first batch.
        assert token_budget_batches([2, 2, 2, 2], 100, max_batch_rows=3) == [[0, 1, 2], [3]]

    def test_empty_input_gives_no_batches(self):
        assert token_budget_batches([], 8) == []

    def test_padding_count_by_hand(self):
        # batch [0, 1] with lengths 5, 2 pads 2 * 5 - 7 = 3; batch [2] pads nothing.
        assert padded_tokens([5, 2, 4], [[0, 1], [2]]) == 3

    def test_keys_keep_a_group_together(self):
        # keys a, b, a, b: group a (rows 0, 2) has the longest row (9), so it comes first, then group b (8, 7).
        # By length alone the order is 0 (9), 1 (8), 3 (7), 2 (3): both batches of 2 would mix the groups.
        assert token_budget_batches([9, 8, 3, 7], 100, max_batch_rows=2, keys="abab") == [[0, 2], [1, 3]]
        assert token_budget_batches([9, 8, 3, 7], 100, max_batch_rows=2) == [[0, 1], [3, 2]]

    def test_keys_a_batch_starting_mid_group_is_padded_to_its_longest_row(self):
        # Order 0 (20), 1 (5) | 2 (18), 3 (17). Budget 36: [0] alone (2 * 20 = 40 > 36); [1, 2] pads to
        # 2 * 18 = 36, not 2 * 5, so row 3 (3 * 18 = 54 > 36) starts the last batch.
        assert token_budget_batches([20, 5, 18, 17], 36, keys="AABB") == [[0], [1, 2], [3]]

    @pytest.mark.parametrize(
        "lengths,budget,rows,match",
        [
            ([1, -2], 8, None, "row 1 has a negative length -2"),
            ([1], 0, None, "token_budget must be >= 1"),
            ([1], 8, 0, "max_batch_rows must be >= 1"),
        ],
    )
    def test_bad_input_names_what(self, lengths, budget, rows, match):
        with pytest.raises(ValueError, match=match):
            token_budget_batches(lengths, budget, max_batch_rows=rows)

    def test_keys_of_another_length_are_named(self):
        with pytest.raises(ValueError, match="keys has 1 entries for 2 rows"):
            token_budget_batches([1, 2], 8, keys=["a"])


lengths_st = st.lists(st.integers(min_value=0, max_value=300), max_size=200)


class TestTokenBudgetBatchesProperties:
    @given(
        lengths=lengths_st,
        budget=st.integers(min_value=1, max_value=4096),
        rows=st.one_of(st.none(), st.integers(min_value=1, max_value=64)),
    )
    @settings(max_examples=300, deadline=None)
    def test_partition_budget_and_order(self, lengths, budget, rows):
        batches = token_budget_batches(lengths, budget, max_batch_rows=rows)
        flat = [i for b in batches for i in b]
        # Every index exactly once.
        assert sorted(flat) == list(range(len(lengths)))
        assert all(b for b in batches)
        for b in batches:
            size = len(b) * max(lengths[i] for i in b)
            # Within budget, except a lone row that is itself over it.
            assert size <= budget or (len(b) == 1 and lengths[b[0]] > budget)
            if rows is not None:
                assert len(b) <= rows
        # Lengths never increase along the concatenated batches (longest first).
        seq = [lengths[i] for i in flat]
        assert seq == sorted(seq, reverse=True)

    @given(
        rows_keys=st.lists(st.tuples(st.integers(min_value=0, max_value=300), st.integers(0, 9)), max_size=200),
        budget=st.integers(min_value=1, max_value=4096),
        rows=st.one_of(st.none(), st.integers(min_value=1, max_value=64)),
    )
    @settings(max_examples=300, deadline=None)
    def test_keys_partition_budget_and_groups_in_one_run(self, rows_keys, budget, rows):
        lengths, keys = [n for n, _ in rows_keys], [k for _, k in rows_keys]
        batches = token_budget_batches(lengths, budget, max_batch_rows=rows, keys=keys)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))
        for b in batches:
            size = len(b) * max(lengths[i] for i in b)
            assert size <= budget or (len(b) == 1 and lengths[b[0]] > budget)
            assert rows is None or len(b) <= rows
        # each key's rows form one run of the order, longest first; the runs by their longest row, descending
        runs = [keys[i] for i, prev in zip(flat, [None, *flat]) if prev is None or keys[prev] != keys[i]]
        assert len(runs) == len(set(keys))
        heads = [lengths[i] for i, prev in zip(flat, [None, *flat]) if prev is None or keys[prev] != keys[i]]
        assert heads == sorted(heads, reverse=True)
        for key in set(keys):
            seq = [lengths[i] for i in flat if keys[i] == key]
            assert seq == sorted(seq, reverse=True)

    @given(lengths=lengths_st, budget=st.integers(min_value=1, max_value=4096))
    @settings(max_examples=200, deadline=None)
    def test_greedy_batches_are_full(self, lengths, budget):
        # A batch closed early would waste budget: the next batch's first row did not fit.
        batches = token_budget_batches(lengths, budget)
        for b, nxt in zip(batches, batches[1:]):
            longest = lengths[b[0]]
            assert (len(b) + 1) * longest > budget

    @given(
        seed=st.integers(min_value=0, max_value=2**32 - 1),
        n=st.integers(min_value=64, max_value=256),
        long_share=st.floats(min_value=0.05, max_value=0.3),
    )
    @settings(max_examples=100, deadline=None)
    def test_pads_less_than_fixed_size_batches_on_skewed_lengths(self, seed, n, long_share):
        # Skewed lengths: mostly short responses (1-16 tokens), at least 4 long ones (200-256), in a
        # random arrival order. The baseline batch size is the one that keeps the same worst-case padded
        # size as the budget (budget // longest row), so both use at most `budget` tokens per batch.
        rng = random.Random(seed)
        n_long = max(4, int(n * long_share))
        lengths = [rng.randint(200, 256) for _ in range(n_long)] + [rng.randint(1, 16) for _ in range(n - n_long)]
        rng.shuffle(lengths)
        budget = 2048
        baseline = fixed_size_batches(n, budget // max(lengths))
        assert padded_tokens(lengths, token_budget_batches(lengths, budget)) < padded_tokens(lengths, baseline)
