"""Toy preference pairs for the digits task, made locally: `chosen` follows the digits rule better than `rejected`.

The rule is engines/toy/task.py's: the reward of a response is the share of its words equal to the prompt's
digit, over max(words, 8). Every pair has rule(chosen) > rule(rejected), so a reward model that ranks the
pairs right has learned the rule's order. Three kinds of pairs, so the model sees what a policy will emit
from its random start to its end:
  perfect   chosen is the digit 8 times; rejected is a random response (below)          (40%)
  graded    two random responses, the one with the higher rule reward chosen           (40%)
  wrong     chosen is mostly the digit; rejected is mostly another digit, 4..8 words     (20%)
A random response has 1..8 words, each the prompt's digit with probability q (q uniform in [0, 1] per
response), else a filler word; the filler is, per response and equally often, any other non-special word,
any other digit, or one other digit throughout. The last two matter: without them a reward model learns
"digits, 8 of them" as much as "the prompt's digit", and PPO on it settles on repeating one wrong digit
("1 1 1 1 1 1 1 1" for every prompt, rule reward 0: seen with the first version of these pairs).

Prompts are chat messages ([{"role": "user", "content": "repeat 3 :"}]) and responses plain text, so the
reward model is trained on the chat-templated text "user : repeat 3 : assistant : 3 3 ..." that the score
stage sends it when PPO runs with model.apply_chat_template=true. (Without the template the query would be
"repeat 3 :3 3 ...", where the toy word-level tokenizer reads ":3" as one unknown word.)

    python -m engines.toy.preferences ./runs/_data/digits-preferences.jsonl [--pairs 4000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from engines.toy.model import DIGITS, WORDS, build_vocab
from engines.toy.task import TARGET_LENGTH, TEMPLATES, digit_reward

KIND_WEIGHTS = {"perfect": 0.4, "graded": 0.4, "wrong": 0.2}
_NON_SPECIAL = [w for w in build_vocab() if not w.startswith("<")]


def random_response(rng: random.Random, digit: str) -> str:
    """1..TARGET_LENGTH words, each `digit` with a per-response probability q, else a filler (module docstring)."""
    q = rng.random()
    other_digits = [d for d in DIGITS if d != digit]
    fillers = rng.choice([[w for w in _NON_SPECIAL if w != digit], other_digits, [rng.choice(other_digits)]])
    return " ".join(digit if rng.random() < q else rng.choice(fillers) for _ in range(rng.randint(1, TARGET_LENGTH)))


def _pair(rng: random.Random, kind: str, digit: str) -> tuple[str, str]:
    if kind == "perfect":
        chosen = " ".join([digit] * TARGET_LENGTH)
        rejected = random_response(rng, digit)
    elif kind == "wrong":
        other = rng.choice([d for d in DIGITS if d != digit])
        words = [digit] * TARGET_LENGTH
        for k in rng.sample(range(TARGET_LENGTH), rng.randint(0, 2)):
            words[k] = rng.choice(WORDS)
        chosen = " ".join(words)
        rejected = " ".join(other if rng.random() < 0.8 else rng.choice(WORDS) for _ in range(rng.randint(4, 8)))
    else:
        chosen, rejected = random_response(rng, digit), random_response(rng, digit)
    if digit_reward(chosen, digit) < digit_reward(rejected, digit):
        chosen, rejected = rejected, chosen
    return chosen, rejected


def make_pairs(num_pairs: int = 4000, seed: int = 0) -> list[dict]:
    """`num_pairs` rows {prompt (chat messages), chosen, rejected, label, kind}, rule(chosen) > rule(rejected)."""
    rng = random.Random(f"ppoflow-toy-preferences-{seed}")
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    rows = []
    while len(rows) < num_pairs:
        digit = str(rng.randrange(10))
        kind = rng.choices(kinds, weights)[0]
        chosen, rejected = _pair(rng, kind, digit)
        if digit_reward(chosen, digit) == digit_reward(rejected, digit):
            continue  # no preference between them: not a pair
        prompt = [{"role": "user", "content": rng.choice(TEMPLATES).format(d=digit)}]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "label": digit, "kind": kind})
    return rows


def build_preferences(out_path: str | Path, num_pairs: int = 4000, seed: int = 0) -> Path:
    """Write make_pairs(...) as a .jsonl file (one pair a line); returns its path."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in make_pairs(num_pairs, seed)))
    return out


def ensure_preferences(out_path: str | Path, **kwargs) -> Path:
    out = Path(out_path)
    return out if out.is_file() else build_preferences(out, **kwargs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_path")
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build_preferences(a.out_path, a.pairs, a.seed))


if __name__ == "__main__":
    main()
