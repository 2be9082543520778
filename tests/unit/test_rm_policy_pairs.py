"""Policy-sample pairs (engines/rm/policy_pairs.py): which samples pair up, the accuracy and the correlation by hand."""

from __future__ import annotations

import math

import pytest

from engines.rm.policy_pairs import pair_accuracy, pearson, rule_pairs
from engines.toy.task import digit_reward


def _row(group, response, label="3"):
    return {"group": group, "prompt": "p: ", "response": response, "label": label}


def test_pairs_are_samples_of_one_prompt_with_different_rule_rewards_higher_first():
    rows = [
        _row(0, "3 3 x"),  # rule 2/8
        _row(0, "x x x"),  # 0
        _row(0, "y y y"),  # 0: ties with the one above, so no pair between them
        _row(1, "3 3 3"),  # 3/8, alone in its group: no pair with group 0's samples
        _row(2, "4", label="4"),  # 1/8
        _row(2, "3 4 4", label="4"),  # 2/8
    ]
    pairs = rule_pairs(rows, digit_reward)
    assert [(p.chosen, p.rejected) for p in pairs] == [
        ("p: 3 3 x", "p: x x x"),
        ("p: 3 3 x", "p: y y y"),
        ("p: 3 4 4", "p: 4"),
    ]
    assert [(p.chosen_rule, p.rejected_rule) for p in pairs] == [(0.25, 0.0), (0.25, 0.0), (0.25, 0.125)]


def test_a_row_without_a_key_is_named():
    with pytest.raises(KeyError, match="rollout row 1 has no group"):
        rule_pairs([_row(0, "3"), {"prompt": "p", "response": "3", "label": "3"}], digit_reward)


def test_accuracy_counts_ties_as_wrong_and_pearson_by_hand():
    assert pair_accuracy([2.0, 1.0, 0.5, 3.0], [1.0, 1.0, 0.7, -1.0]) == 0.5  # right, tie, wrong, right
    with pytest.raises(ValueError, match="2 and 1"):
        pair_accuracy([1.0, 2.0], [0.0])
    # x = 1, 2, 3; y = 2, 2, 5: means 2 and 3; sxy = (-1)(-1) + 0 + (1)(2) = 3; sxx = 2; syy = 1 + 1 + 4 = 6
    assert pearson([1, 2, 3], [2, 2, 5]) == pytest.approx(3 / math.sqrt(12))
    assert math.isnan(pearson([1, 1], [0, 5]))
