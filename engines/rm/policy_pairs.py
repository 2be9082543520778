"""Does a reward model rank the POLICY's samples as a rule does? Pairs built from rollout rows, and the figures.

A reward model can rank its own held-out pairs right and still rank a policy's samples badly when the pairs
look unlike what the policy generates (distribution shift). This is the check on the samples themselves:

- `rule_pairs(rows, rule)`: every two samples of one prompt (one group) whose rule rewards differ, the
  higher one as `chosen`; samples of equal rule reward give no pair (the rule has no preference).
- `pair_accuracy(chosen_scores, rejected_scores)`: share of pairs with score(chosen) > score(rejected); a
  tie counts as wrong, so a constant scorer gets 0, never 0.5 by luck.
- `pearson(x, y)`: the correlation of reward-model score and rule reward over rows.

Pure Python over plain rows; no model here: the caller scores `query` texts (prompt + response, the text the
score stage sends a `kind: model` source) with whatever it measures.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any, Callable, Iterable, NamedTuple, Sequence


class RulePair(NamedTuple):
    chosen: str  # query text (prompt + response) of the sample with the higher rule reward
    rejected: str
    chosen_rule: float
    rejected_rule: float


def rule_pairs(rows: Iterable[dict[str, Any]], rule: Callable[[str, Any], float]) -> list[RulePair]:
    """Pairs of samples of one group with different rule(response, label); in row order.

    rows: dicts with `group` (any hashable: samples of one prompt share it), `prompt`, `response` (text) and
    `label`. Raises KeyError naming the missing key and the row's position.
    """
    groups: dict[Any, list[tuple[str, float]]] = defaultdict(list)
    for i, row in enumerate(rows):
        missing = [k for k in ("group", "prompt", "response", "label") if k not in row]
        if missing:
            raise KeyError(f"rollout row {i} has no {', '.join(missing)} (keys: {sorted(row)})")
        groups[row["group"]].append((row["prompt"] + row["response"], float(rule(row["response"], row["label"]))))
    pairs = []
    for samples in groups.values():
        for (qa, ra), (qb, rb) in itertools.combinations(samples, 2):
            if ra > rb:
                pairs.append(RulePair(qa, qb, ra, rb))
            elif rb > ra:
                pairs.append(RulePair(qb, qa, rb, ra))
    return pairs


def pair_accuracy(chosen_scores: Sequence[float], rejected_scores: Sequence[float]) -> float:
    """Share of pairs whose chosen side scores strictly higher. Raises ValueError on unequal lengths or none."""
    if len(chosen_scores) != len(rejected_scores) or not chosen_scores:
        raise ValueError(f"need equal, non-zero numbers of scores, got {len(chosen_scores)} and {len(rejected_scores)}")
    return sum(c > r for c, r in zip(chosen_scores, rejected_scores)) / len(chosen_scores)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation; NaN when either side is constant. Raises ValueError on unequal lengths or < 2 values."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two equal sequences of >= 2 values, got {len(x)} and {len(y)}")
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")
