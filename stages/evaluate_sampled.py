"""The eval's second pass: the held-out prompts sampled as the rollout samples them, for pass@k beside greedy.

    sampled_due(cfg, iteration) -> bool                          eval.sampled_pass_at_k says this eval has the pass
    sample_as_rollout(engine, source, records, cfg, seeds, iteration) -> rows   rollout.n_samples each, rollout sampling
    sampled_metrics(scored rows, n) -> {eval/sampled_*}

Why: greedy accuracy says what the policy answers; it does not say whether GRPO can learn. A group of
rollout.n_samples samples teaches only when its rewards differ, so the number that predicts a learning signal is
measured under the rollout's own sampling: eval/sampled_pass@k (k = rollout.n_samples: the share of prompts where
at least one of k samples is correct, Chen et al.'s unbiased estimator, engines/evaluation.py) and
eval/sampled_spread (the share of prompts whose k rewards are not all equal: the groups that would carry signal).
A model with greedy accuracy 0.03 and sampled_pass@4 0.10 has ~10% of groups to learn from: too few
(flows/signal_advice.py says so during training).

Also eval/sampled_accuracy (share of samples scored 1.0) and eval/sampled_reward_mean, from
engines/evaluation.eval_metrics. Scored through the score cache like the eval's own rows; not written as shards
(the eval's shards are the eval.* samples). Single-turn only: with rollout.environment the pass is skipped.
"""

from __future__ import annotations

import pyarrow as pa

from engines.evaluation import eval_metrics, pass_at_k
from engines.rollout.base import SamplingSettings


def sampled_due(cfg, iteration: int) -> bool:
    """Whether the eval of `iteration` (0 = before training) runs the sampled pass."""
    if cfg.rollout.environment is not None or cfg.eval.sampled_pass_at_k == "never":
        return False
    return cfg.eval.sampled_pass_at_k == "every" or iteration == 0


def sample_as_rollout(engine, source, records: list, cfg, seeds: list, iteration: int) -> pa.Table:
    """`records` sampled with the rollout's settings (rollout.n_samples, temperature, top_p/k, max_new_tokens) as
    rollout rows, records[i] with seeds[i]."""
    from stages.rollout import sample_table

    return sample_table(engine, source, records, SamplingSettings.from_config(cfg.rollout), seeds, iteration)


def sampled_metrics(scored: pa.Table, n: int) -> dict[str, float]:
    """eval/sampled_* of the scored rows, n consecutive rows per held-out prompt (module docstring). ValueError
    from eval_metrics when the row count is not a multiple of n.

    pass@k counts a sample as correct when its reward is 1.0, as eval/accuracy does, whenever every reward is in
    [0, 1]: reasoning-gym's scorers give partial credit (0.01 for a wrong number), which leaves eval_metrics' own
    pass@k (0/1 rewards only) out, while 1.0 is still their "correct"."""
    rewards = scored.column("reward").to_pylist()
    metrics = {k.replace("eval/", "eval/sampled_", 1): v for k, v in eval_metrics(rewards, n, ks=()).items()}
    groups = [rewards[p : p + n] for p in range(0, len(rewards), n)]
    if "eval/sampled_accuracy" in metrics:
        correct = [sum(r == 1.0 for r in g) for g in groups]
        metrics[f"eval/sampled_pass@{n}"] = sum(pass_at_k(n, c, n) for c in correct) / len(correct)
    metrics["eval/sampled_spread"] = sum(max(g) != min(g) for g in groups) / len(groups)
    return metrics
