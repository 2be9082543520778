"""Metrics of an evaluation pass over held-out prompts: eval/reward_mean; for rewards in [0, 1], eval/accuracy (the
share of samples scored 1.0: a task scorer's "correct", partial credit below it); for 0/1 rewards, eval/pass@k.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
eq. 1): with n samples of a prompt of which c are correct,
    pass@k = 1 - C(n - c, k) / C(n, k)
computed as the product 1 - prod_{i = n - c + 1}^{n} (1 - k / i) (their numerically stable form), averaged
over prompts. It is the chance that at least one of k samples drawn without replacement from the n is
correct; drawing n >= k samples and using the estimator has lower variance than drawing exactly k.

Pure Python; the eval stage (issue 21, the lead's) samples and scores, then calls `eval_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples, c correct. ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def eval_metrics(rewards: Sequence[float], group_size: int, ks: Sequence[int] = (1,)) -> dict[str, float]:
    """eval/reward_mean over all samples; eval/accuracy (share of rewards equal to 1.0) when every reward is in
    [0, 1]; eval/pass@k (k in ks, k <= group_size) when every reward is 0 or 1.

    rewards: flat, prompt by prompt: rows [p * group_size, (p + 1) * group_size) are prompt p's samples.
    Non-binary rewards give no pass@k key (pass@k needs a notion of "correct").
    Raises ValueError for an empty list, a length not a multiple of group_size, or a k outside [1, group_size].
    """
    if not rewards or group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"eval_metrics: {len(rewards)} rewards is not a non-empty multiple of group_size={group_size}")
    bad_k = [k for k in ks if not 1 <= k <= group_size]
    if bad_k:
        raise ValueError(f"eval_metrics: k {bad_k} outside [1, group_size={group_size}]")
    metrics = {"eval/reward_mean": sum(rewards) / len(rewards)}
    if all(0.0 <= r <= 1.0 for r in rewards):  # a score in [0, 1] (reasoning-gym's): 1.0 is a correct answer
        metrics["eval/accuracy"] = sum(r == 1.0 for r in rewards) / len(rewards)
    if all(r in (0.0, 1.0) for r in rewards):
        correct = [int(sum(rewards[p : p + group_size])) for p in range(0, len(rewards), group_size)]
        for k in ks:
            metrics[f"eval/pass@{k}"] = sum(pass_at_k(group_size, c, k) for c in correct) / len(correct)
    return metrics
