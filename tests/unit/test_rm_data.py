"""Preference data: rendering as the reward source will see it, bad rows, truncation, the split, the batches."""

from __future__ import annotations

import json

import pytest

from engines.rm.batching import batch_for_step, collate
from engines.rm.data import PreferenceDataError, PreferencePairs, load_preferences, split_indices
from engines.toy.model import build_tokenizer
from engines.toy.preferences import make_pairs
from engines.toy.task import digit_reward
from ppoflow.rm_config import RMTrainConfig


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(path, **kw):
    return RMTrainConfig(data_path=path, batch_size=1, micro_batch_size=1, eval_fraction=0.0, **kw)


def test_plain_text_is_tokenized_as_the_reward_source_tokenizes_its_queries(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "repeat 3 : ", "chosen": "3 3", "rejected": "4 4"}])
    data = load_preferences(_cfg(path), tokenizer, seed=0)
    # engines/rewards/model.py scores tokenizer(prompt + response, add_special_tokens=True)
    assert data.train.chosen_ids == [tokenizer("repeat 3 : 3 3")["input_ids"]]
    assert data.train.rejected_ids == [tokenizer("repeat 3 : 4 4")["input_ids"]]
    assert data.train.chosen_ids[0][0] == tokenizer.bos_token_id


def test_chat_rows_use_the_chat_template_like_a_chat_prompt_plus_response(tmp_path, tokenizer):
    prompt = [{"role": "user", "content": "repeat 3 :"}]
    path = _write(tmp_path, [{"prompt": prompt, "chosen": "3 3", "rejected": "4 4"}])
    data = load_preferences(_cfg(path), tokenizer, seed=0)
    # What PPO with model.apply_chat_template sends the reward model: the templated prompt + the response
    query = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) + "3 3"
    assert data.train.chosen_ids == [tokenizer(query)["input_ids"]]


@pytest.mark.parametrize(
    "row, why",
    [
        ({"prompt": "say 1 :", "chosen": "1", "rejected": None}, "rejected is missing"),
        ({"prompt": "say 1 :", "chosen": "1 1", "rejected": "1 1"}, "the same text"),
        ({"prompt": "", "chosen": "1", "rejected": "2"}, "prompt is missing or empty"),
    ],
)
def test_a_bad_row_is_an_error_naming_it_or_dropped_and_counted(tmp_path, tokenizer, row, why):
    good = {"prompt": "say 2 :", "chosen": "2", "rejected": "3"}
    path = _write(tmp_path, [good, good, row])
    with pytest.raises(PreferenceDataError, match=f"row 2: .*{why}"):
        load_preferences(_cfg(path), tokenizer, seed=0)
    data = load_preferences(_cfg(path, bad_rows="drop"), tokenizer, seed=0)
    assert data.train.rows == [0, 1] and data.dropped == {"train/bad_row": 1}


def test_a_missing_column_names_it(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "say 2 :", "good": "2", "rejected": "3"}])
    with pytest.raises(KeyError, match="'chosen'.*rm_train.chosen_key"):
        load_preferences(_cfg(path), tokenizer, seed=0)


def test_truncation_policies(tmp_path, tokenizer):
    # BOS + 6 x please + say 2 : + 2 2 = 12 tokens (the prompt ends in a space: plain text is joined as it is)
    long_row = {"prompt": "please " * 6 + "say 2 : ", "chosen": "2 2", "rejected": "3 3"}
    path = _write(tmp_path, [long_row, {"prompt": "say 2 :", "chosen": "2", "rejected": "3"}])
    with pytest.raises(
        PreferenceDataError, match="row 0: prompt \\+ chosen has 12 tokens, more than rm_train.max_length=8"
    ):
        load_preferences(_cfg(path, max_length=8), tokenizer, seed=0)
    dropped = load_preferences(_cfg(path, max_length=8, truncation="drop"), tokenizer, seed=0)
    assert dropped.train.rows == [1] and dropped.dropped == {"train/too_long": 1}
    cut = load_preferences(_cfg(path, max_length=8, truncation="truncate_left"), tokenizer, seed=0)
    # BOS kept, then the last 7 of the other 11 tokens: the prompt loses its first 4 words, the response none
    tokens = tokenizer.convert_ids_to_tokens(cut.train.chosen_ids[0])
    assert tokens == ["<s>", "please", "please", "say", "2", ":", "2", "2"]


def test_margin_column_and_eval_split(tmp_path, tokenizer):
    rows = [{"prompt": f"say {d} :", "chosen": str(d), "rejected": "w1", "m": 0.5} for d in range(10)]
    path = _write(tmp_path, rows)
    cfg = RMTrainConfig(data_path=path, batch_size=2, micro_batch_size=1, margin_key="m", eval_fraction=0.2)
    data = load_preferences(cfg, tokenizer, seed=7)
    assert len(data.train) == 8 and len(data.eval) == 2 and set(data.train.rows).isdisjoint(data.eval.rows)
    assert data.train.margins == [0.5] * 8
    assert split_indices(10, 0.2, 7) == split_indices(10, 0.2, 7) != split_indices(10, 0.2, 8)


def test_toy_pairs_follow_the_rule_and_offer_no_shortcut():
    rows = make_pairs(600, seed=1)
    assert all(digit_reward(r["chosen"], r["label"]) > digit_reward(r["rejected"], r["label"]) for r in rows)
    assert {r["kind"] for r in rows} == {"perfect", "graded", "two_bases"}
    # One-base pairs: the length never tells the sides apart.
    same_base = [r for r in rows if r["kind"] != "two_bases"]
    assert all(len(r["chosen"].split()) == len(r["rejected"].split()) for r in same_base)

    # Wrong digits are no cue: of the words that are not the prompt's digit, the side with the larger share of other
    # digits is the chosen one about as often as the rejected one (a model that learnt "digits are good", the trap
    # PPO fell into with the first pairs, or "digits are bad", would rank about half of these pairs wrong).
    def wrong_digit_share(text, label):
        others = [w for w in text.split() if w != label]
        return sum(w.isdigit() for w in others) / len(others) if others else None

    shares = [(wrong_digit_share(r["chosen"], r["label"]), wrong_digit_share(r["rejected"], r["label"])) for r in rows]
    decided = [c > r for c, r in shares if c is not None and r is not None and c != r]
    assert len(decided) > 200 and 0.35 < sum(decided) / len(decided) < 0.65


class TestBatches:
    lengths = [5, 1, 9, 3, 7, 2, 8, 4, 6, 10, 11]  # 11 pairs, batches of 3: 3 steps per epoch, 2 left out

    def test_an_epoch_visits_all_but_the_leftovers_once_in_length_sorted_batches(self):
        for epoch in range(3):
            batches = [batch_for_step(self.lengths, 3, seed=0, step=epoch * 3 + k) for k in range(3)]
            seen = [i for b in batches for i in b]
            assert len(seen) == len(set(seen)) == 9
            # length-sorted: every batch's pairs are one contiguous run of the sorted lengths
            ranks = sorted(seen, key=lambda i: self.lengths[i])
            runs = {tuple(sorted(ranks[k : k + 3])) for k in range(0, 9, 3)}
            assert {tuple(sorted(b)) for b in batches} == runs

    def test_the_step_number_is_the_whole_cursor(self):
        assert batch_for_step(self.lengths, 3, 0, 4) == batch_for_step(list(self.lengths), 3, 0, 4)
        left_out = [
            set(range(11)) - {i for k in range(3) for i in batch_for_step(self.lengths, 3, 0, e * 3 + k)}
            for e in range(4)
        ]
        assert len({frozenset(s) for s in left_out}) > 1  # a different few are left out each epoch

    def test_collate_puts_chosen_rows_then_rejected_rows(self):
        pairs = PreferencePairs([[1, 2, 3], [1, 4]], [[1, 5], [1, 6, 7, 8]], [0.0, 1.0], [0, 1])
        right = collate(pairs, [1, 0], pad_token_id=0, padding_side="right")
        assert right.input_ids.tolist() == [[1, 4, 0, 0], [1, 2, 3, 0], [1, 6, 7, 8], [1, 5, 0, 0]]
        assert right.attention_mask.tolist() == (right.input_ids != 0).long().tolist()
        left = collate(pairs, [1, 0], pad_token_id=0)
        assert left.input_ids.tolist() == [[0, 0, 1, 4], [0, 1, 2, 3], [1, 6, 7, 8], [0, 0, 1, 5]]
        assert left.attention_mask.tolist() == (left.input_ids != 0).long().tolist()
        assert left.margins.tolist() == [1.0, 0.0] and left.pairs == 2
