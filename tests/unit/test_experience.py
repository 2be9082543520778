"""ExperienceBatch.from_lists: finish reasons, optional sampler log-probs, the loss mask."""
import pytest
import torch

from engines.trainer.experience import ExperienceBatch


def _batch(**kwargs):
    return ExperienceBatch.from_lists([[1, 2], [1], [3]], [[4, 5, 6], [7], [8, 9]], [1.0, 0.0, 0.5],
                                      [[-1.0] * 3, [-1.0], [-1.0] * 2], **kwargs)


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
