"""Rewards from reasoning-gym's own scorers, for rows made by `data.reasoning_gym` (engines/reasoning_tasks.py).

Each function is a veRL-contract reward function (`compute_score(data_source, solution_str, ground_truth,
extra_info)`): data_source is the task's name, ground_truth the row's label (the task's entry as JSON). It
takes the answer out of the response one way, then returns the task's `score_answer(answer, entry)`
(reasoning_gym.get_score_answer_fn): 1.0 for a correct answer; many tasks give partial credit below that
(the default scorer: len(answer) / len(text) when the text contains the answer, so "8" beats "3 + 5 = 8").

How the answer is taken from the response (name the function in reward.sources[].target):
    engines.rewards.reasoning_tasks:score_response     the whole response, stripped (the model must answer
                                                       with the answer alone to get 1.0)
    engines.rewards.reasoning_tasks:score_answer_tag   the text of the last <answer>...</answer>
                                                       (reasoning_gym.utils.extract_answer; none = 0)
    engines.rewards.reasoning_tasks:score_last_line    the last non-empty line, stripped
    engines.rewards.reasoning_tasks:score_last_number  the last number in the response (lenient: "3 + 5 = 8"
                                                       scores as "8")
    engines.rewards.reasoning_tasks:score_digits       the last number, with partial credit per digit for an
                                                       integer answer (below)
score_digits is for tasks whose answer is an integer (sums, products): a wrong integer earns the share of digit
places it gets right, counted from the units place, over the longer of the two numbers' digit counts ("10154" for
10155: 4/5; "155" for 10155: 3/5; "-5" for 5: 0). That is always < 1, so a run's eval/accuracy (rewards equal to
1.0) still counts exact answers only. Why: on a sum the model gets wrong almost always, a group of samples that
are all wrong still differ in how many columns they added right, so GRPO has something to learn from (each
column's digit is the same skill at every length). An answer or label that is not an integer falls back to the
task's own scorer (score_last_number).
Errors: a label that is not an entry's JSON raises ValueError naming the task and the label's start.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_INTEGER = re.compile(r"-?\d+")


@functools.lru_cache(maxsize=None)
def _scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def _entry(task: str, ground_truth: Any) -> dict:
    try:
        entry = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    except json.JSONDecodeError:
        entry = None
    if not isinstance(entry, dict) or "answer" not in entry:
        raise ValueError(
            f"reasoning-gym task {task!r}: the label must be the task's entry as JSON (question, answer, "
            f"metadata), as data.reasoning_gym writes it; got {str(ground_truth)[:80]!r}"
        )
    return entry


def _score(task: str, answer: Optional[str], ground_truth: Any) -> float:
    return float(_scorer(task)(answer, _entry(task, ground_truth)))


def last_line(text: str) -> Optional[str]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def last_number(text: str) -> Optional[str]:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def score_response(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return _score(data_source, solution_str.strip(), ground_truth)


def score_answer_tag(data_source, solution_str, ground_truth, extra_info=None) -> float:
    from reasoning_gym.utils import extract_answer

    return _score(data_source, extract_answer(solution_str), ground_truth)


def score_last_line(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return _score(data_source, last_line(solution_str), ground_truth)


def score_last_number(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return _score(data_source, last_number(solution_str), ground_truth)


def digit_credit(answer: str, truth: str) -> float:
    """Share of digit places `answer` gets right against `truth`, both integers as text (module docstring):
    1.0 when equal as integers; 0.0 when the signs differ; else matching places from the units up over the longer
    digit count (< 1)."""
    a, t = int(answer), int(truth)
    if a == t:
        return 1.0
    if (a < 0) != (t < 0):
        return 0.0
    a_digits, t_digits = str(abs(a))[::-1], str(abs(t))[::-1]
    same = sum(x == y for x, y in zip(a_digits, t_digits))
    return same / max(len(a_digits), len(t_digits))


def score_digits(data_source, solution_str, ground_truth, extra_info=None) -> float:
    answer = last_number(solution_str)
    truth = str(_entry(data_source, ground_truth)["answer"]).strip()
    if answer is None or not _INTEGER.fullmatch(answer) or not _INTEGER.fullmatch(truth):
        return _score(data_source, answer, ground_truth)
    return digit_credit(answer, truth)
