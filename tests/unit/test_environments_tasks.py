"""The built-in learnable task DigitEcho: rewards by hand, observations the tiny model's vocabulary can read."""

from __future__ import annotations

import pytest

from engines.environments.checked import CheckedEnvironment, EnvironmentFailed
from engines.environments.digit_echo import make_rows
from engines.environments.loader import load_environment_factory
from engines.toy.model import build_tokenizer

SPEC = "engines.environments.digit_echo:DigitEcho"


def _play(row: dict, replies: list[str]) -> list:
    env = CheckedEnvironment.start(load_environment_factory(SPEC), row_index=0)
    assert env.reset(row) is None
    messages, observations = [{"role": "user", "content": row["prompt"]}], []
    for reply in replies:
        messages.append({"role": "assistant", "content": reply})
        observations.append(env.step(messages))
        messages.append({"role": observations[-1].role, "content": observations[-1].text})
    env.close()
    return observations


def test_heeding_every_turn_scores_one():
    row = {"prompt": "repeat 3 :", "label": "3 7 1"}
    observations = _play(row, ["3 3 3 3 3 3 3 3", "7 7 7 7 7 7 7 7", "1 1 1 1 1 1 1 1"])
    assert [(o.text, o.role, o.done) for o in observations] == [
        ("now repeat 7 :", "user", False),
        ("now repeat 1 :", "user", False),
        ("", "user", True),
    ]
    assert sum(o.reward for o in observations) == pytest.approx(1.0)


def test_ignoring_the_environment_scores_by_hand():
    # Turn 1 right (1/3); turn 2 repeats 3 where 7 is wanted (0); turn 3: four 1s in eight words (0.5 / 3).
    observations = _play({"prompt": "say 3 :", "label": "3 7 1"}, ["3 3 3 3 3 3 3 3", "3 3 3", "1 1 1 1 2 2 2 2"])
    assert [o.reward for o in observations] == pytest.approx([1 / 3, 0.0, 0.5 / 3])


def test_observations_stay_inside_the_tiny_vocabulary():
    tokenizer = build_tokenizer()
    for row in make_rows(20, seed=4):
        for digit in row["label"].split():
            ids = tokenizer(f"now repeat {digit} :", add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids
        assert tokenizer.unk_token_id not in tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]


def test_rows_are_deterministic_and_the_first_digit_is_in_the_prompt():
    rows = make_rows(50, seed=2, turns=4)
    assert rows == make_rows(50, seed=2, turns=4) != make_rows(50, seed=3, turns=4)
    assert all(len(r["label"].split()) == 4 and r["label"][0] in r["prompt"].split() for r in rows)


def test_a_bad_label_is_named():
    env = CheckedEnvironment.start(load_environment_factory(SPEC), row_index=9)
    with pytest.raises(EnvironmentFailed, match=r"\(row 9\) reset: raised ValueError: .* got '3 x'"):
        env.reset({"prompt": "repeat 3 :", "label": "3 x"})
