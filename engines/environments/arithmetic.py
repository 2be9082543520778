"""A multi-turn task that a small model can learn: multiply two numbers, with a calculator to call.

Each row asks for a product too large to guess (3 digits by 2 by default). The policy may write
`<calc>347 * 29</calc>`; the calculator (run sandboxed, engines/environments/calculator.py) answers in a
"tool" turn; the reply without a call is the final answer: reward 1 when its last integer is the product,
else 0. Calling the calculator and copying its result is what wins the reward, so the reward rises as the
policy learns the two-turn pattern (a pretrained 135M model copies numbers well and computes products badly).

Deterministic given the row: the reward depends only on the row's `label` and the policy's replies.
Config: `rollout.environment.source: engines.environments.arithmetic:CalculatorArithmetic`, with a dataset
built by

    python -m engines.environments.arithmetic ./runs/_data/calc-arithmetic.jsonl [--rows 512] [--seed 0]
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Mapping, Optional

from engines.environments.datasets import write_rows
from engines.environments.tool_env import ToolCallingEnvironment
from engines.environments.tools import SandboxedTool, ToolLimits
from engines.toy.cli import toy_main

PROMPT = (
    "What is {a} * {b}? You have a calculator: write the expression between <calc> and </calc>, "
    "for example <calc>12 * 7</calc>, and its result comes back. Then reply with the final number alone."
)
_INTEGER = re.compile(r"-?\d+")


class CalculatorArithmetic(ToolCallingEnvironment):
    """The task above; the row needs `label` (the product, as text or an integer)."""

    tools = {
        "calc": SandboxedTool("engines.environments.calculator:evaluate", "calculator", ToolLimits(5.0, 128)),
    }
    max_tool_calls = 3
    success_reward = 1.0  # the right product: info "is_success", eval/accuracy

    def reset(self, row: Mapping[str, Any]) -> Optional[str]:
        if not _INTEGER.fullmatch(str(row.get("label", "")).strip()):
            raise ValueError(f"the row's label must be the product as an integer, got {row.get('label')!r}")
        return super().reset(row)

    def score(self, answer: str) -> float:
        numbers = _INTEGER.findall(answer.replace(",", ""))
        return 1.0 if numbers and int(numbers[-1]) == int(str(self.row["label"]).strip()) else 0.0


def make_rows(num_rows: int = 512, seed: int = 0, left_digits: int = 3, right_digits: int = 2) -> list[dict]:
    """`num_rows` rows {prompt, label, data_source}; the operands are drawn from random.Random(seed)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a = rng.randrange(10 ** (left_digits - 1), 10**left_digits)
        b = rng.randrange(10 ** (right_digits - 1), 10**right_digits)
        rows.append({"prompt": PROMPT.format(a=a, b=b), "label": str(a * b), "data_source": "calc_arithmetic"})
    return rows


def build_dataset(out: str | Path, num_rows: int = 512, seed: int = 0) -> Path:
    """Write make_rows(...) as a .jsonl file (one row a line) and return its path."""
    return write_rows(out, make_rows(num_rows, seed))


def main(argv: list[str] | None = None) -> None:
    toy_main(__doc__, build_dataset, {"--rows": "num_rows", "--seed": "seed"}, argv)


if __name__ == "__main__":
    main()
