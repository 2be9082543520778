"""Bradley-Terry loss and accuracy by hand, and the last-token score under left, right and no padding."""

from __future__ import annotations

import math

import pytest
import torch

from engines.rm.loss import bradley_terry, last_token_index, sequence_scores


class TestBradleyTerry:
    def test_loss_and_accuracy_by_hand(self):
        chosen = torch.tensor([2.0, 0.0, -1.0])
        rejected = torch.tensor([1.0, 0.0, 1.0])
        # diffs 1, 0, -2: losses log(1 + e^-1) = 0.313262, log 2 = 0.693147, log(1 + e^2) = 2.126928
        stats = bradley_terry(chosen, rejected)
        want = [math.log1p(math.exp(-1.0)), math.log(2.0), math.log1p(math.exp(2.0))]
        assert stats.per_pair_loss.tolist() == pytest.approx(want, abs=1e-6)
        assert float(stats.loss) == pytest.approx(sum(want) / 3, abs=1e-6)  # 1.044446
        assert float(stats.accuracy) == pytest.approx(1 / 3)  # only pair 0 is ranked right; a tie is not
        assert float(stats.margin_mean) == pytest.approx((1 + 0 - 2) / 3)

    def test_margin_shifts_the_difference_not_the_accuracy(self):
        # diff 1 with margin 1 is diff 0: log 2; accuracy still counts r_c > r_r
        stats = bradley_terry(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1.0]))
        assert float(stats.loss) == pytest.approx(math.log(2.0), abs=1e-7)
        assert float(stats.accuracy) == 1.0

    def test_large_differences_stay_finite(self):
        stats = bradley_terry(torch.tensor([-200.0, 200.0]), torch.tensor([200.0, -200.0]))
        assert stats.per_pair_loss.tolist() == pytest.approx([400.0, 0.0])

    def test_a_higher_chosen_score_never_raises_the_loss(self):
        rejected = torch.zeros(1)
        losses = [float(bradley_terry(torch.tensor([x]), rejected).loss) for x in (-3.0, -1.0, 0.0, 1.0, 3.0)]
        assert losses == sorted(losses, reverse=True)

    def test_bad_shapes_are_errors(self):
        with pytest.raises(ValueError, match="shape"):
            bradley_terry(torch.zeros(2), torch.zeros(3))
        with pytest.raises(ValueError, match="P = 0"):
            bradley_terry(torch.zeros(0), torch.zeros(0))


class TestLastTokenIndex:
    def test_right_left_and_no_padding(self):
        mask = torch.tensor(
            [
                [1, 1, 1, 0, 0],  # right-padded: last token at column 2
                [0, 0, 1, 1, 1],  # left-padded: column 4
                [1, 1, 1, 1, 1],
            ]
        )  # full: column 4
        assert last_token_index(mask).tolist() == [2, 4, 4]

    def test_an_empty_row_is_an_error(self):
        with pytest.raises(ValueError, match="no token"):
            last_token_index(torch.tensor([[0, 0]]))


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    from engines.toy.reward_model import build_tiny_reward_model

    folder = build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm", seed=1)
    return AutoModelForSequenceClassification.from_pretrained(folder).eval()


def test_last_token_score_is_the_same_under_left_right_and_no_padding(tiny_reward_model):
    model = tiny_reward_model
    pad = model.config.pad_token_id
    rows = [[1, 14, 7, 21, 7, 7], [1, 15, 9, 21]]
    with torch.no_grad():  # HF's own pooling of each row alone, no padding
        alone = [float(model(input_ids=torch.tensor([r])).logits[0, 0]) for r in rows]
    width = max(len(r) for r in rows)
    for side in ("right", "left"):
        ids = torch.full((2, width), pad)
        mask = torch.zeros((2, width), dtype=torch.long)
        for j, r in enumerate(rows):
            cols = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
            ids[j, cols], mask[j, cols] = torch.tensor(r), 1
        with torch.no_grad():
            ours = sequence_scores(model, ids, mask)
        assert ours.tolist() == pytest.approx(alone, abs=1e-5), side
    with torch.no_grad():  # under left padding the last layer's MLP saw only the last column (and changed nothing)
        widths = []
        inside_mlp = model.model.layers[-1].mlp.down_proj  # sees what the MLP computes, after the trim
        hook = inside_mlp.register_forward_pre_hook(lambda _m, args: widths.append(args[0].shape[1]))
        sequence_scores(model, ids, mask)
        hook.remove()
    assert widths == [1]
    with torch.no_grad():  # and the model's own forward agrees on right padding (what the reward source feeds)
        ids[:] = pad
        ids[0, :6], ids[1, :4] = torch.tensor(rows[0]), torch.tensor(rows[1])
        hf = model(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, 0]
    assert hf.tolist() == pytest.approx(alone, abs=1e-5)


def test_sequence_scores_rejects_a_causal_lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(TypeError, match="ForSequenceClassification"):
        sequence_scores(model, torch.tensor([[1, 2]]), torch.tensor([[1, 1]]))
