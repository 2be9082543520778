"""engines/trainer/epoch_order.py: the order an epoch visits the rows, by groups (the default) or by rows."""

import torch

from engines.trainer.epoch_order import epoch_order


def _groups_of(order: torch.Tensor, group_ids: torch.Tensor) -> list[list[int]]:
    """The order cut where the group id changes: [[rows of one group], ...]."""
    runs: list[list[int]] = []
    for row in order.tolist():
        if runs and group_ids[runs[-1][-1]] == group_ids[row]:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def test_groups_stay_whole_and_in_batch_order_and_every_row_comes_once():
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    order = epoch_order(0, 0, 0, group_ids, "groups")
    assert sorted(order.tolist()) == list(range(16))
    runs = _groups_of(order, group_ids)
    assert len(runs) == 4  # each group one run of its 4 rows, in batch order
    assert all(run == list(range(run[0], run[0] + 4)) and run[0] % 4 == 0 for run in runs)
    # so steps of 8 rows (the README recipe's half batch, scaled) hold 2 whole groups each
    assert all(len(set(group_ids[order[s : s + 8]].tolist())) == 2 for s in (0, 8))


def test_groups_of_other_sizes_stay_whole():
    group_ids = torch.tensor([5, 5, 5, 7, 9, 9])  # a dropped sample leaves groups of 3, 1 and 2
    for update in range(20):
        order = epoch_order(1, update, 0, group_ids, "groups")
        assert sorted(order.tolist()) == list(range(6))
        assert sorted(map(tuple, _groups_of(order, group_ids))) == [(0, 1, 2), (3,), (4, 5)]


def test_one_sample_per_prompt_is_the_row_shuffle():
    """A group of one row is a row: both settings are the same seeded permutation."""
    group_ids = torch.arange(12)
    for update in range(5):
        torch.testing.assert_close(
            epoch_order(3, update, 1, group_ids, "groups"), epoch_order(3, update, 1, group_ids, "rows")
        )


def test_the_seed_the_update_and_the_epoch_each_change_the_order_and_nothing_else_does():
    group_ids = torch.arange(32) // 2
    base = epoch_order(0, 4, 1, group_ids, "groups")
    torch.testing.assert_close(epoch_order(0, 4, 1, group_ids, "groups"), base)  # resumed: the same order
    for other in ((1, 4, 1), (0, 5, 1), (0, 4, 2)):
        assert not torch.equal(epoch_order(*other, group_ids, "groups"), base)


def test_rows_shuffle_splits_groups():
    """The other setting does shuffle samples one by one: over 20 updates some group is split somewhere."""
    group_ids = torch.arange(16) // 4
    split = [len(_groups_of(epoch_order(0, u, 0, group_ids, "rows"), group_ids)) > 4 for u in range(20)]
    assert any(split)
