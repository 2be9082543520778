"""The built-in learnable tasks: DigitEcho (rewards by hand, observations the tiny model's vocabulary can read,
through the rollout driver) and GuessTheNumber (binary search always wins, a policy deaf to the feedback wins
4 times in 10)."""

from __future__ import annotations

import json

import pytest

from engines.environments.checked import CheckedEnvironment, EnvironmentFailed
from engines.environments.digit_echo import make_rows
from engines.environments.loader import load_environment_factory
from engines.toy.model import build_tokenizer

SPEC = "engines.environments.digit_echo:DigitEcho"


def _play(row: dict, replies: list[str], spec: str = SPEC) -> list:
    env = CheckedEnvironment.start(load_environment_factory(spec), row_index=0)
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
    assert [o.info["is_success"] for o in observations] == [False, False, True]  # every turn perfect: a success


def test_ignoring_the_environment_scores_by_hand():
    # Turn 1 right (1/3); turn 2 repeats 3 where 7 is wanted (0); turn 3: four 1s in eight words (0.5 / 3).
    observations = _play({"prompt": "say 3 :", "label": "3 7 1"}, ["3 3 3 3 3 3 3 3", "3 3 3", "1 1 1 1 2 2 2 2"])
    assert [o.reward for o in observations] == pytest.approx([1 / 3, 0.0, 0.5 / 3])
    assert observations[-1].info == {"is_success": False}
    # all three digits repeated, but turn 2 with 7 words of 8 (7/8): not a success
    almost = _play({"prompt": "say 3 :", "label": "3 7 1"}, ["3 3 3 3 3 3 3 3", "7 7 7 7 7 7 7", "1 1 1 1 1 1 1 1"])
    assert sum(o.reward for o in almost) == pytest.approx((1 + 7 / 8 + 1) / 3) and not almost[-1].info["is_success"]


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


def test_digit_echo_through_the_multi_turn_rollout(tiny_model_dir):
    """The rollout driver (engines/rollout/multi_turn.py) with HF generate on the tiny model: each sample's
    env_reward is the digits reward of its own decoded turns, recomputed here from the conversation."""
    from engines.rollout.base import SamplingSettings
    from engines.rollout.hf import HFRolloutEngine
    from engines.rollout.multi_turn import ConversationStart, TurnLimits, run_conversations
    from engines.toy.task import digit_reward

    engine = HFRolloutEngine(str(tiny_model_dir), seed=0, max_batch_size=8)
    tok = engine.tokenizer
    starts = []
    for index, row in enumerate(make_rows(2, seed=5, turns=3)):
        text = tok.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        starts.append(ConversationStart(index, dict(row, index=index), row["prompt"], text, ids, seed=100 + index))
    sampling = SamplingSettings(n=2, max_new_tokens=8, temperature=1.0)
    samples = run_conversations(engine, tok, load_environment_factory(SPEC), starts, sampling, TurnLimits(3, 200))
    assert len(samples) == 4
    for sample in samples:
        digits = starts[sample.prompt_index].row["label"].split()
        replies = [m["content"] for m in sample.messages if m["role"] == "assistant"]
        asked = [m["content"] for m in sample.messages[1:] if m["role"] == "user"]
        assert sample.turns == len(replies) == 3 and sample.truncation is None
        assert asked == [f"now repeat {d} :" for d in digits[1:]]
        expected = sum(digit_reward(reply, digit) for reply, digit in zip(replies, digits)) / 3
        assert sample.env_reward == pytest.approx(expected)
        assert tok.unk_token_id not in sample.response_ids


GUESS = "engines.environments.guess_number:GuessTheNumber"


def _guessing(secret: int, policy) -> tuple[float, int]:
    """(reward, guesses) of one episode; `policy(feedback so far)` returns the next reply."""
    env = CheckedEnvironment.start(load_environment_factory(GUESS), row_index=0)
    env.reset({"prompt": "guess", "label": str(secret), "high": 10, "guesses": 4})
    messages, feedback = [{"role": "user", "content": "guess"}], []
    while True:
        messages.append({"role": "assistant", "content": policy(feedback)})
        obs = env.step(messages)
        if obs.done:
            env.close()
            return obs.reward, env.turn
        feedback.append(obs.text)
        messages.append({"role": "user", "content": obs.text})


def _binary_search(feedback: list[str]) -> str:
    low, high, guess = 1, 10, None
    for said in feedback:  # replay the guesses made so far against what the environment said
        guess = (low + high) // 2
        low, high = (guess + 1, high) if said == "Higher." else (low, guess - 1)
    return f"My guess is {(low + high) // 2}."


def test_binary_search_always_wins_within_four_guesses():
    results = [_guessing(secret, _binary_search) for secret in range(1, 11)]
    assert all(reward == 1.0 and guesses <= 4 for reward, guesses in results)
    assert max(guesses for _, guesses in results) == 4  # ceil(log2(11)): some secret needs all four


def test_a_policy_deaf_to_feedback_wins_four_times_in_ten():
    rewards = [_guessing(secret, lambda feedback: str(len(feedback) + 1))[0] for secret in range(1, 11)]
    assert rewards == [1.0] * 4 + [0.0] * 6


def test_guess_feedback_and_a_reply_without_a_number():
    observations = _play(
        {"prompt": "guess", "label": "7", "high": 10, "guesses": 4}, ["5", "no idea", "9", "seven"], GUESS
    )
    assert [(o.text, o.reward, o.done) for o in observations] == [
        ("Higher.", 0.0, False),
        ("Reply with one whole number from 1 to 10.", 0.0, False),
        ("Lower.", 0.0, False),
        ("", 0.0, True),
    ]
    assert [o.info for o in observations] == [{"guess": g, "is_success": False} for g in (5, None, 9, None)]
    won = _play({"prompt": "guess", "label": "7", "high": 10, "guesses": 4}, ["5", "My guess is 7."], GUESS)
    assert won[-1].done and won[-1].info == {"guess": 7, "is_success": True}


def test_guess_rows_are_deterministic_and_a_bad_label_is_named(tmp_path):
    from engines.environments.guess_number import make_rows as guess_rows

    rows = guess_rows(200, seed=1)
    assert rows == guess_rows(200, seed=1) and {r["label"] for r in rows} == {str(n) for n in range(1, 11)}
    from engines.environments.guess_number import main

    held_out = tmp_path / "held-out.jsonl"
    main([str(held_out), "--every-secret", "2"])  # the recipe's eval set: every secret, K rows each, in order
    labels = [json.loads(line)["label"] for line in held_out.read_text().splitlines()]
    assert labels == [str(n) for n in range(1, 11) for _ in range(2)]
    env = CheckedEnvironment.start(load_environment_factory(GUESS), row_index=4)
    with pytest.raises(EnvironmentFailed, match=r"\(row 4\) reset: raised ValueError: the row needs a label from 1"):
        env.reset({"prompt": "guess", "label": "11"})


SHAPED = "engines.environments.guess_number:ShapedGuessTheNumber"


def test_shaped_guess_credits_possible_guesses_and_early_wins_by_hand():
    row = {"prompt": "guess", "label": "7", "high": 10, "guesses": 4}
    # 5 possible (0.1) -> Higher, [6, 10]; no number (0); 9 possible (0.1) -> Lower, [6, 8]; 8 possible (0.1), lost
    lost = _play(row, ["5", "no idea", "9", "8"], SHAPED)
    assert [o.text for o in lost] == ["Higher.", "Reply with one whole number from 1 to 10.", "Lower.", ""]
    assert [o.reward for o in lost] == pytest.approx([0.1, 0.0, 0.1, 0.1]) and lost[-1].done
    # 5 possible (0.1); 3 and 5 again contradict "Higher." (0 each); 7 possible and right with guess 4: 0.1 + 0.7
    won = _play(row, ["5", "3", "5", "My guess is 7."], SHAPED)
    assert [o.reward for o in won] == pytest.approx([0.1, 0.0, 0.0, 0.8]) and won[-1].done
    assert [o.reward for o in _play({**row, "label": "5"}, ["5"], SHAPED)] == pytest.approx([1.1])


def _shaped_episode(secret: int, replies, spec: str = SHAPED) -> tuple[float, int, bool]:
    """(summed reward, guesses, won) of `replies(feedback so far)` against ShapedGuessTheNumber (or `spec`)."""
    env = CheckedEnvironment.start(load_environment_factory(spec), row_index=0)
    env.reset({"prompt": "guess", "label": str(secret)})
    messages, feedback, total = [{"role": "user", "content": "guess"}], [], 0.0
    while True:
        messages.append({"role": "assistant", "content": replies(feedback)})
        obs = env.step(messages)
        total += obs.reward
        if obs.done:
            env.close()
            return total, len(messages) // 2, obs.info.get("guess") == secret
        feedback.append(obs.text)
        messages.append({"role": "user", "content": obs.text})


def test_shaped_guess_a_win_is_a_reward_above_one_half():
    """Binary search makes every guess possible: 0.1 per guess plus 1.0 - 0.1 * (guesses - 1) for the win, 1.1
    whatever the secret; random replies win with a reward from 0.8 to 1.1 and lose with at most 0.4."""
    import random

    for secret in range(1, 11):
        total, guesses, won = _shaped_episode(secret, _binary_search)
        assert won and total == pytest.approx(1.1), (secret, guesses)
    rng = random.Random(0)
    for _ in range(300):
        secret = rng.randint(1, 10)
        total, _, won = _shaped_episode(secret, lambda feedback: rng.choice(["x", *map(str, range(0, 12))]))
        assert (total > 0.5) == won and (0.8 - 1e-9 <= total <= 1.1 + 1e-9 if won else total <= 0.4 + 1e-9)


INFORMATIVE = "engines.environments.guess_number:InformativeGuessTheNumber"


def test_information_credit_by_hand():
    row = {"prompt": "guess", "label": "7", "high": 10, "guesses": 4}
    # halving: 5 -> Higher, [6, 10]: 5 of 10 ruled out, 0.2 * 5/10; 9 -> Lower, [6, 8]: 2 of 5; 6 -> Higher, [7, 8]:
    # 1 of 3; 7 right with guess 4: 1 of the 2 left ruled out, 0.2 * 1/2, plus the 1.0 - 0.3 bonus
    halving = _play(row, ["5", "9", "6", "My guess is 7."], INFORMATIVE)
    assert [o.reward for o in halving] == pytest.approx([0.1, 0.08, 0.2 / 3, 0.1 + 0.7]) and halving[-1].done
    # counting up, deaf to "Higher.": 1 of 10, 1 of 9, 1 of 8, 1 of 7 ruled out; lost
    counting = _play(row, ["1", "2", "3", "4"], INFORMATIVE)
    assert [o.reward for o in counting] == pytest.approx([0.2 / 10, 0.2 / 9, 0.2 / 8, 0.2 / 7])
    # a guess the feedback already ruled out (3 after "Higher." on 5), no number, a number out of range: nothing
    wasted = _play(row, ["5", "3", "no idea", "11"], INFORMATIVE)
    assert [o.reward for o in wasted] == pytest.approx([0.1, 0.0, 0.0, 0.0])
    assert [o.info["is_success"] for o in halving] == [False, False, False, True]


def test_information_credit_favours_the_middle_and_a_win_stays_above_one_half():
    """The mean first-guess credit over the 10 secrets is highest at 5 and 6: a guess g rules out 11 - g numbers
    when the secret is below it, g when above, 9 when right: mean 0.2 * ((g-1)(11-g) + (10-g) g + 9) / 100."""
    import random

    for g in range(1, 11):
        credits = [_play({"prompt": "guess", "label": str(s)}, [str(g)], INFORMATIVE)[0].reward for s in range(1, 11)]
        bonus = 1.0  # the secret g is found at once
        mean = (sum(credits) - bonus) / 10
        assert mean == pytest.approx(0.2 * ((g - 1) * (11 - g) + (10 - g) * g + 9) / 100), g
    assert max(range(1, 11), key=lambda g: (g - 1) * (11 - g) + (10 - g) * g) in (5, 6)
    rng = random.Random(1)
    for _ in range(300):
        secret = rng.randint(1, 10)
        total, _, won = _shaped_episode(
            secret, lambda feedback: rng.choice(["x", *map(str, range(0, 12))]), INFORMATIVE
        )
        assert (total > 0.5) == won and (total >= 0.7 - 1e-9 if won else total <= 0.36)
