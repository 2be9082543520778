"""The digits toy task: the prompt names a digit, the reward is the share of response words equal to it.

A random policy over the 64-word vocabulary scores about 0.02; the right policy (emit the digit until the
length cap) scores 1. The denominator is max(len(response words), TARGET_LENGTH), so stopping early,
emitting EOS or pad, or padding with other words all score lower: no shortcut exists.

The reward is exposed in both contracts people already use:
- OpenRLHF: `reward_func(queries, prompts, labels, **kwargs) -> {"rewards": [...]}`
- veRL:     `compute_score(data_source, solution_str, ground_truth, extra_info) -> float`

    python -m engines.toy.task ./runs/_data/digits
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

from engines.toy.cli import toy_main

TARGET_LENGTH = 8
TEMPLATES = ["repeat {d} :", "say {d} :", "write the digit {d} :", "copy number {d} :"]


def digit_reward(response: str, label: Any) -> float:
    """Share of the response's words equal to `label` (a digit), over max(words, TARGET_LENGTH)."""
    words = response.split()
    target = str(label)
    hits = sum(1 for w in words if w == target)
    return hits / max(len(words), TARGET_LENGTH)


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs) -> dict:
    """OpenRLHF contract: queries are prompt + response text."""
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt) :] if query.startswith(prompt) else query
        rewards.append(digit_reward(response, label))
    return {"rewards": rewards}


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """veRL contract: solution_str is the response text."""
    return digit_reward(solution_str, ground_truth)


def make_rows(num_rows: int = 512, seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    prompts, labels = [], []
    for _ in range(num_rows):
        d = rng.randrange(10)
        prompts.append(rng.choice(TEMPLATES).format(d=d))
        labels.append(str(d))
    return {"prompt": prompts, "label": labels, "data_source": ["digits"] * num_rows}


def build_digits_dataset(out_dir: str | Path, num_rows: int = 512, seed: int = 0) -> Path:
    """A `datasets.Dataset` made in code and saved with save_to_disk, like any other dataset."""
    from datasets import Dataset

    out = Path(out_dir)
    Dataset.from_dict(make_rows(num_rows, seed)).save_to_disk(str(out))
    return out


def built_once(out: Path, marker_files: tuple[str, ...], build) -> Path:
    """`out` when it already holds every marker file (built before), else `build(out)`'s result."""
    return out if all((out / name).exists() for name in marker_files) else build(out)


def ensure_digits_dataset(out_dir: str | Path, **kwargs) -> Path:
    """Build the digits dataset unless `out_dir` already holds one (a datasets save_to_disk folder)."""
    return built_once(Path(out_dir), ("dataset_info.json",), lambda out: build_digits_dataset(out, **kwargs))


def main(argv: list[str] | None = None) -> None:
    toy_main(__doc__, build_digits_dataset, {"--rows": "num_rows", "--seed": "seed"}, argv)


if __name__ == "__main__":
    main()
