"""ExperienceBatch.from_lists: finish reasons, optional sampler log-probs, the loss mask."""

import pytest
import torch

from engines.trainer.experience import ExperienceBatch


def _batch(**kwargs):
    return ExperienceBatch.from_lists(
        [[1, 2], [1], [3]], [[4, 5, 6], [7], [8, 9]], [1.0, 0.0, 0.5], [[-1.0] * 3, [-1.0], [-1.0] * 2], **kwargs
    )


def test_finish_reasons_mark_truncated_rows_and_the_loss_mask_drops_them():
    batch = _batch(finish_reasons=["length", "stop", "length"])
    assert batch.truncated.tolist() == [True, False, True]
    assert batch.loss_mask(False).tolist() == batch.response_mask.tolist()
    assert batch.loss_mask(True).tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    sub = batch.select(torch.tensor([2, 1]))
    assert sub.truncated.tolist() == [True, False] and sub.rollout_logprobs is None


def test_without_finish_reasons_masking_is_refused():
    batch = _batch()
    assert batch.truncated is None and batch.rollout_logprobs is None
    with pytest.raises(ValueError, match="train.mask_truncated needs each sample's finish_reason"):
        batch.loss_mask(True)


def test_bad_finish_reasons_name_the_row():
    with pytest.raises(ValueError, match="row 1: finish_reason 'abort'"):
        _batch(finish_reasons=["stop", "abort", "stop"])
    with pytest.raises(ValueError, match="finish_reasons has 2 rows, prompt_ids has 3"):
        _batch(finish_reasons=["stop", "stop"])
    with pytest.raises(ValueError, match="row 2: rollout_logprobs has 1 values for 2 response tokens"):
        _batch(rollout_logprobs=[[0.0] * 3, [0.0], [0.0]])


class TestPadding:
    """right_pad / left_pad (vectorised) against a plain per-row loop, and a hand-written case."""

    @staticmethod
    def _loop_right(rows, width, value, dtype):
        out = torch.full((len(rows), width), value, dtype=dtype)
        for b, row in enumerate(rows):
            out[b, : len(row)] = torch.tensor(list(row), dtype=dtype)
        return out

    def test_by_hand(self):
        from engines.trainer.experience import left_pad, right_pad

        assert right_pad([[1.5], [], [2.0, 3.0]], 2, -1.0, torch.float32).tolist() == [
            [1.5, -1.0],
            [-1.0, -1.0],
            [2.0, 3.0],
        ]
        ids, mask = left_pad([[7], [8, 9]], 3, 0)
        assert ids.tolist() == [[0, 0, 7], [0, 8, 9]] and mask.tolist() == [[0, 0, 1], [0, 1, 1]]

    def test_equals_a_per_row_loop(self):
        import random

        from engines.trainer.experience import left_pad, right_pad

        rng = random.Random(0)
        floats = [[rng.uniform(-3, 1) for _ in range(rng.randint(0, 9))] for _ in range(200)]
        ints = [[rng.randint(0, 500) for _ in range(rng.randint(0, 9))] for _ in range(200)]
        assert torch.equal(right_pad(floats, 9, 0.0, torch.float32), self._loop_right(floats, 9, 0.0, torch.float32))
        assert torch.equal(right_pad(ints, 9, 3, torch.long), self._loop_right(ints, 9, 3, torch.long))
        ids, mask = left_pad(ints, 9, 3)
        flipped = [list(reversed(r)) for r in ints]  # left padding = right padding of the reversed rows, flipped
        assert torch.equal(ids, self._loop_right(flipped, 9, 3, torch.long).flip(1))
        assert torch.equal(mask, self._loop_right([[1] * len(r) for r in ints], 9, 0, torch.long).flip(1))

    def test_a_row_longer_than_the_width_is_named(self):
        from engines.trainer.experience import right_pad

        with pytest.raises(ValueError, match="row 1 has 3 values for 2 columns"):
            right_pad([[1.0], [1.0, 2.0, 3.0]], 2, 0.0, torch.float32)
