"""Toy preference pairs for the digits task, made locally: `chosen` follows the digits rule better than `rejected`.

The rule is engines/toy/task.py's: the reward of a response is the number of its words equal to the prompt's
digit over max(words, 8); responses of the toy PPO run have at most 8 words, so it is hits / 8.

The pairs are built to be ranked right ON THE POLICY'S OWN SAMPLES, not only on themselves. A first version
(perfect vs random, graded random pairs whose digit share q was uniform in [0, 1]) reached 0.985 on its own
held-out pairs but 0.73 on pairs of the random-init policy's samples (same prompt, different rule reward),
and PPO on it stalled at rule reward 0.38: its random responses were mostly digits, while the policy's are
mostly other words with a rare digit, and it scored a repeated wrong digit ("7 7 7 ...") above other words
though the rule gives both 0, a local optimum for PPO. So here every pair is an edit of a BASE response that
looks like the random-init policy's samples (each word uniform over the toy vocabulary's non-special words;
8 words, or 1..7 as when EOS comes early), and the two sides differ in the number of correct digits:

  graded     one base; chosen has more words set to the digit than rejected; half the time rejected's digit
             positions are a subset of chosen's (a minimal pair: one more right word is better)     (60%)
  two_bases  two bases (other words, other lengths), with different numbers of correct digits      (20%)
  perfect    chosen is the digit 8 times; rejected is another digit 8 times or 5..7 right of 8      (20%)

The words that are not the digit are, per side independently and equally often, the base's own words, one
other digit throughout, random other digits, or the base with some words turned into one other digit: so
wrong digits come with both sides and carry no preference of their own (the trap above). A side's length
never decides a pair: both sides of a one-base pair have the base's length.

Prompts are chat messages ([{"role": "user", "content": "repeat 3 :"}]) and responses plain text, so the
reward model is trained on the chat-templated text "user : repeat 3 : assistant : 3 3 ..." that the score
stage sends it when PPO runs with model.apply_chat_template=true. (Without the template the query would be
"repeat 3 :3 3 ...", where the toy word-level tokenizer reads ":3" as one unknown word.)

    python -m engines.toy.preferences ./runs/_data/digits-preferences.jsonl [--pairs 4000] [--seed 0]
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from engines.toy.cli import toy_main
from engines.toy.model import DIGITS, build_vocab
from engines.toy.task import TARGET_LENGTH, TEMPLATES, digit_reward

KIND_WEIGHTS = {"graded": 0.6, "two_bases": 0.2, "perfect": 0.2}
FILLER_MODES = ("base", "one_digit", "digits", "some_digit")
_NON_SPECIAL = [w for w in build_vocab() if not w.startswith("<")]


def base_response(rng: random.Random) -> list[str]:
    """Words like the random-init toy policy's: uniform over non-special words; 8 of them, 1..7 one time in 5."""
    length = TARGET_LENGTH if rng.random() < 0.8 else rng.randint(1, TARGET_LENGTH - 1)
    return [rng.choice(_NON_SPECIAL) for _ in range(length)]


def make_side(rng: random.Random, base: list[str], digit: str, positions: set[int], mode: str) -> str:
    """`base` with exactly the words at `positions` equal to `digit`; the others filled as `mode` says
    (FILLER_MODES: the base's words (a digit among them replaced), one other digit, random other digits,
    or the base with each word turned into one other digit with probability 1/2)."""
    others = [d for d in DIGITS if d != digit]
    fillers = [w for w in _NON_SPECIAL if w != digit]
    one = rng.choice(others)
    words = []
    for k, word in enumerate(base):
        if k in positions:
            words.append(digit)
        elif mode == "one_digit" or (mode == "some_digit" and rng.random() < 0.5):
            words.append(one)
        elif mode == "digits":
            words.append(rng.choice(others))
        else:
            words.append(word if word != digit else rng.choice(fillers))
    return " ".join(words)


def _counts(rng: random.Random, length_hi: int, length_lo: int) -> tuple[int, int]:
    """(hits of chosen, hits of rejected): 1 <= chosen <= length_hi, 0 <= rejected < chosen, rejected <= length_lo."""
    hi = rng.randint(1, length_hi)
    return hi, rng.randint(0, min(hi - 1, length_lo))


def _pair(rng: random.Random, kind: str, digit: str) -> tuple[str, str]:
    mode = lambda: rng.choice(FILLER_MODES)  # noqa: E731 (drawn per side)
    if kind == "perfect":
        full = list(range(TARGET_LENGTH))
        rejected_hits = set(rng.sample(full, rng.choice([0, 5, 6, 7])))
        base = [rng.choice(_NON_SPECIAL) for _ in full]
        return " ".join([digit] * TARGET_LENGTH), make_side(rng, base, digit, rejected_hits, "one_digit")
    if kind == "two_bases":
        base_c, base_r = base_response(rng), base_response(rng)
        hi, lo = _counts(rng, len(base_c), len(base_r))
        chosen = make_side(rng, base_c, digit, set(rng.sample(range(len(base_c)), hi)), mode())
        return chosen, make_side(rng, base_r, digit, set(rng.sample(range(len(base_r)), lo)), mode())
    base = base_response(rng)
    hi, lo = _counts(rng, len(base), len(base))
    chosen_hits = rng.sample(range(len(base)), hi)
    pool = chosen_hits if rng.random() < 0.5 else range(len(base))  # nested: a minimal pair
    rejected_hits = rng.sample(list(pool), lo)
    return make_side(rng, base, digit, set(chosen_hits), mode()), make_side(
        rng, base, digit, set(rejected_hits), mode()
    )


def make_pairs(num_pairs: int = 4000, seed: int = 0) -> list[dict]:
    """`num_pairs` rows {prompt (chat messages), chosen, rejected, label, kind}, rule(chosen) > rule(rejected)."""
    rng = random.Random(f"ppoflow-toy-preferences-v2-{seed}")
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    rows = []
    while len(rows) < num_pairs:
        digit = str(rng.randrange(10))
        kind = rng.choices(kinds, weights)[0]
        chosen, rejected = _pair(rng, kind, digit)
        if digit_reward(chosen, digit) <= digit_reward(rejected, digit):  # cannot happen by construction
            raise AssertionError(f"toy pair {kind} breaks the rule: {chosen!r} vs {rejected!r} for {digit}")
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
    toy_main(__doc__, build_preferences, {"--pairs": "num_pairs", "--seed": "seed"}, argv)


if __name__ == "__main__":
    main()
