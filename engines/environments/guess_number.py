"""Guess the number with higher / lower feedback: a multi-turn task for a small pretrained model (135M).

The row's `label` is the secret, a whole number from 1 to `high` (the prompt says the range and the number of
guesses). Each policy turn's first integer is its guess; the environment answers "Higher." or "Lower." (a user
turn), and the episode ends with reward 1 when a guess is right, or with reward 0 after `guesses` wrong ones. A
reply without an integer costs a guess too ("Reply with one whole number from 1 to 10."). Binary search finds
any secret from 1 to 10 in 4 guesses, so reward 1 is reachable on every row; four distinct guesses at random
find it 4 times in 10, and a policy that ignores the feedback cannot do better than that on average, so the
reward rises above 0.4 only as the policy uses what the environment tells it. Every step's info holds the guess
(None without one) and "is_success" (the guess was right), so the eval stage's eval/accuracy is the games won.

ShapedGuessTheNumber is the same game with partial credit (a guess still possible given the feedback) and more
reward for fewer guesses, so a policy that has not won yet still has a gradient (configs/multi_turn_guess_number.yaml).

Deterministic given the row. Config: `rollout.environment.source: engines.environments.guess_number:GuessTheNumber`,
with a dataset built by

    python -m engines.environments.guess_number ./runs/_data/guess-number.jsonl [--rows 512] [--seed 0]

and a held-out set of every secret from 1 to 10, K rows each (the recipe's eval.data_path), by

    python -m engines.environments.guess_number ./runs/_data/guess-number-eval.jsonl --every-secret K
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from engines.environments.base import Message, Observation
from engines.environments.datasets import write_rows
from engines.toy.cli import toy_main

PROMPT = (
    "I am thinking of a whole number from 1 to {high}. Guess it: reply with one number, and I will tell you "
    "whether mine is higher or lower. You have {guesses} guesses."
)
_INTEGER = re.compile(r"-?\d+")


class GuessTheNumber:
    """The task above; the row needs `label` (the secret) and may set `high` (10) and `guesses` (4)."""

    def __init__(self):
        self.secret, self.high, self.guesses_left = 0, 10, 4

    def reset(self, row: Mapping[str, Any]) -> Optional[str]:
        self.high, self.guesses_left = int(row.get("high", 10)), int(row.get("guesses", 4))
        label = str(row.get("label", "")).strip()
        if not label.isdigit() or not 1 <= int(label) <= self.high or self.guesses_left < 1:
            raise ValueError(
                f"the row needs a label from 1 to high={self.high} and guesses >= 1, "
                f"got label={row.get('label')!r}, guesses={self.guesses_left}"
            )
        self.secret = int(label)
        return None

    def step(self, messages: list[Message]) -> Observation:
        found = _INTEGER.search(messages[-1]["content"])
        guess = int(found.group()) if found else None
        self.guesses_left -= 1
        info = {"guess": guess, "is_success": guess == self.secret}  # is_success: eval/accuracy is games won
        if guess == self.secret:
            return Observation(reward=1.0, done=True, info=info)
        if self.guesses_left == 0:
            return Observation(reward=0.0, done=True, info=info)
        if guess is None:
            return Observation(text=f"Reply with one whole number from 1 to {self.high}.", info=info)
        return Observation(text="Higher." if self.secret > guess else "Lower.", info=info)

    def close(self) -> None:
        pass


class ShapedGuessTheNumber(GuessTheNumber):
    """GuessTheNumber with a reward that has signal before the policy ever wins (issue 39 item 6).

    Per guess: 0.1 when it is a whole number still possible given the feedback so far (inside the interval that
    "Higher." / "Lower." left, so a repeated or contradicting guess, a number out of range or no number gets 0).
    On finding the secret with guess k (1-based): 1.0 - 0.1 * (k - 1) more, so fewer guesses score more.
    A sample's reward is the sum over its turns: at most 1.1 (right at once), at least 0.8 when it wins at all,
    at most 0.4 when it does not (four possible guesses, none right): a win is env_reward > 0.5.

    `credit` (a class attribute; the factory takes no arguments) picks the per-guess credit: "possible" (above),
    or "information" (InformativeGuessTheNumber).
    """

    credit: Literal["possible", "information"] = "possible"

    def reset(self, row: Mapping[str, Any]) -> Optional[str]:
        first = super().reset(row)
        self.low, self.top, self.guesses_made = 1, self.high, 0
        return first

    def step(self, messages: list[Message]) -> Observation:
        found = _INTEGER.search(messages[-1]["content"])
        guess = int(found.group()) if found else None
        self.guesses_made += 1
        possible, before = guess is not None and self.low <= guess <= self.top, self.top - self.low + 1
        if guess is not None and guess != self.secret:  # what the feedback will tell
            self.low, self.top = (
                (max(self.low, guess + 1), self.top) if self.secret > guess else (self.low, min(self.top, guess - 1))
            )
        if self.credit == "possible":
            credit = 0.1 if possible else 0.0
        else:  # the share of the still-possible numbers this guess rules out; a right guess leaves only itself
            after = 1 if guess == self.secret else self.top - self.low + 1
            credit = INFORMATION_WEIGHT * (before - after) / before
        outcome = super().step(messages)
        bonus = 1.0 - 0.1 * (self.guesses_made - 1) if outcome.reward > 0 else 0.0
        return Observation(outcome.text, outcome.role, credit + bonus, outcome.done, outcome.info)


INFORMATION_WEIGHT = 0.2


class InformativeGuessTheNumber(ShapedGuessTheNumber):
    """ShapedGuessTheNumber whose per-guess credit grows with what the guess teaches: 0.2 x the share of the numbers
    still possible before it that its feedback rules out ((before - after) / before; a right guess rules out all
    but itself). A guess that halves the range earns ~0.1 whatever the secret; counting up from 1 earns 0.02 for
    "1" (1 of 10 ruled out), 0.022 for "2", ...; a contradicting guess or no number rules out nothing: 0.

    Why: with "possible" credit every still-possible guess earns the same 0.1, so counting up 1, 2, 3, 4 (deaf
    to the feedback) earns as much partial credit as halving, and that is what the 135M policy learned (README).
    Bounds (1 to 10, 4 guesses): four guesses that miss rule out shares f1..f4 with (1 - f1)...(1 - f4) >= 1/10
    (the secret is left), so f1 + ... + f4 <= 4 x (1 - 10^(-1/4)) ~ 1.75 and a lost game scores at most ~0.35; a
    win scores at least its 0.7 bonus: a win is still env_reward > 0.5.
    Config: configs/multi_turn_guess_number_information.yaml.
    """

    credit = "information"


def make_rows(num_rows: int = 512, seed: int = 0, high: int = 10, guesses: int = 4) -> list[dict]:
    """`num_rows` rows {prompt, label, high, guesses, data_source}; secrets from random.Random(seed)."""
    rng = random.Random(seed)
    prompt = PROMPT.format(high=high, guesses=guesses)
    return [
        {"prompt": prompt, "label": str(rng.randint(1, high)), "high": high, "guesses": guesses, "data_source": "guess"}
        for _ in range(num_rows)
    ]


def every_secret_rows(per_secret: int = 1, high: int = 10, guesses: int = 4) -> list[dict]:
    """Every secret 1..high, `per_secret` rows each, in order: a held-out set that weighs every secret alike
    (the eval set of configs/multi_turn_guess_number.yaml); no randomness."""
    prompt = PROMPT.format(high=high, guesses=guesses)
    return [
        {"prompt": prompt, "label": str(secret), "high": high, "guesses": guesses, "data_source": "guess"}
        for secret in range(1, high + 1)
        for _ in range(per_secret)
    ]


def build_dataset(out: str | Path, num_rows: int = 512, seed: int = 0, every_secret: int = 0) -> Path:
    """Write make_rows(num_rows, seed), or with every_secret > 0 every_secret_rows(every_secret), as a .jsonl file
    (one row a line) and return its path."""
    rows = every_secret_rows(every_secret) if every_secret > 0 else make_rows(num_rows, seed)
    return write_rows(out, rows)


def main(argv: list[str] | None = None) -> None:
    options = {"--rows": "num_rows", "--seed": "seed", "--every-secret": "every_secret"}
    toy_main(__doc__, build_dataset, options, argv)


if __name__ == "__main__":
    main()
