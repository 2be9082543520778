"""A multi-turn task the tiny model learns in minutes: repeat the digit the newest user turn names.

The row's `label` is a digit per turn ("3 7 1"). Turn 1's digit is in the prompt ("repeat 3 :"); after each
policy turn the environment names the next one ("now repeat 7 :"), in words the tiny model's word-level
vocabulary holds (engines/toy/model.py), so nothing becomes <unk>. Turn t's reward is the digits toy task's
(engines/toy/task.py digit_reward: the share of the reply's words equal to the digit, over at least 8 words)
divided by the number of turns, so a sample's reward, the sum over its turns, lies in [0, 1]: about 0.02 for
a random policy, 1 for one that repeats the newest digit (a success, info "is_success": every reply was the
digit alone, at least 8 times; the eval stage's eval/accuracy). Only the environment's turns say which digit is
wanted after turn 1: a policy that ignores them and repeats the first digit scores 1/T + 0.1 (T-1)/T on
average over T turns (0.4 for 3), one that heeds them 1.

Deterministic given the row. Config: `rollout.environment.source: engines.environments.digit_echo:DigitEcho`,
with a dataset built by

    python -m engines.environments.digit_echo ./runs/_data/digit-echo.jsonl [--rows 512] [--seed 0] [--turns 3]
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Mapping, Optional

from engines.environments.base import Message, Observation
from engines.environments.datasets import write_rows
from engines.toy.cli import toy_main
from engines.toy.task import TEMPLATES, digit_reward


class DigitEcho:
    """The task above; the row needs `label`: one digit per turn, separated by spaces."""

    def __init__(self):
        self.digits: list[str] = []
        self.turn = 0
        self.perfect = True  # every reply so far was the digit only, at least 8 times (digit_reward 1)

    def reset(self, row: Mapping[str, Any]) -> Optional[str]:
        digits = str(row.get("label", "")).split()
        if not digits or not all(len(d) == 1 and d.isdigit() for d in digits):
            got = row.get("label")
            raise ValueError(f"the row's label must be digits separated by spaces (one per turn), got {got!r}")
        self.digits, self.turn, self.perfect = digits, 0, True
        return None

    def step(self, messages: list[Message]) -> Observation:
        share = digit_reward(messages[-1]["content"], self.digits[self.turn])
        self.perfect = self.perfect and share == 1.0
        self.turn += 1
        if self.turn == len(self.digits):
            return Observation(reward=share / len(self.digits), done=True, info={"is_success": self.perfect})
        text = f"now repeat {self.digits[self.turn]} :"
        return Observation(text=text, reward=share / len(self.digits), info={"is_success": False})

    def close(self) -> None:
        pass


def make_rows(num_rows: int = 512, seed: int = 0, turns: int = 3) -> list[dict]:
    """`num_rows` rows {prompt, label, data_source}, drawn from random.Random(seed)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        digits = [str(rng.randrange(10)) for _ in range(turns)]
        prompt = rng.choice(TEMPLATES).format(d=digits[0])
        rows.append({"prompt": prompt, "label": " ".join(digits), "data_source": "digit_echo"})
    return rows


def build_dataset(out: str | Path, num_rows: int = 512, seed: int = 0, turns: int = 3) -> Path:
    """Write make_rows(...) as a .jsonl file (one row a line) and return its path."""
    return write_rows(out, make_rows(num_rows, seed, turns))


def main(argv: list[str] | None = None) -> None:
    toy_main(__doc__, build_dataset, {"--rows": "num_rows", "--seed": "seed", "--turns": "turns"}, argv)


if __name__ == "__main__":
    main()
