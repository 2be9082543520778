"""The one line a run prints when its prompt groups stop carrying a learning signal, and what to try.

    signal_share(row) -> float | None          the share of sampled groups whose rewards differ, of one metrics row
    signal_advice(rows, cfg) -> str | None     the advice, once the last signal.advice_after rows are all below
                                               signal.advice_below; None otherwise

A group estimator learns nothing from a group whose rewards are all equal (engines/ppo/signal.py). The share is
signal/group_spread of the trained batch; with rollout.dynamic_sampling on, the trained batch holds only groups
with spread by construction, so the share of the groups *sampled* is used instead (1 - rollout/
zero_variance_sampled_fraction): that is what says whether the task suits the model. Rows without either (one
sample per prompt, a rebuilt row) break the run of iterations: the advice needs measured values.

The caller says it once per process (flows/run.py's table); the text names the iterations, the shares, the
threshold, the initial eval's greedy accuracy and sampled pass@k when the run has them, and the settings to try.
"""

from __future__ import annotations

from typing import Any, Optional


def signal_share(row: dict[str, Any]) -> Optional[float]:
    """The sampled groups' spread share of one metrics row (module docstring), or None when it was not measured."""
    if row.get("rollout/zero_variance_sampled_fraction") is not None:
        return 1.0 - float(row["rollout/zero_variance_sampled_fraction"])
    share = row.get("signal/group_spread")
    return None if share is None else float(share)


def _tries(cfg, last: dict[str, Any]) -> list[str]:
    """What to try, in the order that costs least to try: settings the run does not use yet first. `last`: the
    newest row (a curriculum run above its start level gets the advice about its step)."""
    tries = []
    spec = cfg.data.reasoning_gym
    plan = None if spec is None else spec.curriculum
    level = last.get("curriculum/level")
    if plan is not None and level is not None and level > plan.start_level:
        tries.append(
            f"a smaller step to curriculum level {int(level)} (an intermediate entry in data.reasoning_gym."
            f"curriculum.levels, or range_mode: inclusive, which keeps the easier problems in the mix)"
        )
    if not cfg.rollout.dynamic_sampling.enabled:
        tries.append("rollout.dynamic_sampling.enabled=true (sample until groups differ)")
    n = cfg.rollout.n_samples  # a value to set: the current one alone read as the advice (seen: "n_samples=4" at 4)
    tries.append(f"more samples per prompt (rollout.n_samples={2 * n}, now {n})")
    tries.append("an easier task (data.reasoning_gym.config) or a higher rollout.temperature")
    if plan is None:
        tries.append("a curriculum (data.reasoning_gym.curriculum) that starts where the model succeeds sometimes")
    return tries


def _initial_eval(rows: list[dict[str, Any]]) -> str:
    initial = next((r for r in rows if r.get("iteration") == 0), {})
    parts = [f"greedy accuracy {initial['eval/accuracy']:.3f}"] if "eval/accuracy" in initial else []
    sampled = [k for k in sorted(initial) if k.startswith(("eval/sampled_pass@", "eval/sampled_spread"))]
    parts += [f"{k.removeprefix('eval/')} {initial[k]:.3f}" for k in sampled]
    return f"; initial eval: {', '.join(parts)}" if parts else ""


def signal_advice(rows: list[dict[str, Any]], cfg) -> Optional[str]:
    """The advice line when the last cfg.signal.advice_after training rows (iteration >= 1, in iteration order)
    all have a share below cfg.signal.advice_below; None otherwise (too few rows, one not measured, one at or
    above the threshold, or advice_below 0)."""
    below, after = cfg.signal.advice_below, cfg.signal.advice_after
    training = sorted((r for r in rows if int(r.get("iteration", 0)) >= 1), key=lambda r: int(r["iteration"]))
    last = training[-after:]
    if below <= 0 or len(last) < after:
        return None
    shares = [signal_share(r) for r in last]
    if any(s is None or s >= below for s in shares):
        return None
    first, final = int(last[0]["iteration"]), int(last[-1]["iteration"])
    return (
        f"little to learn from: in iterations {first}-{final} only {', '.join(f'{s:.2f}' for s in shares)} of the "
        f"prompt groups had rewards that differ (below signal.advice_below={below}), and a group whose samples all "
        f"score the same gives GRPO nothing{_initial_eval(rows)}. Try: {'; '.join(_tries(cfg, last[-1]))}."
    )
