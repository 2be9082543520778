"""DAPO's dynamic sampling as pure functions (Yu et al. 2025, "DAPO", section 3.2).

A group (the rollout.n_samples responses of one prompt) whose rewards are all equal has zero advantage
under every group estimator: it adds no gradient, only dilutes the batch. Dynamic sampling drops such
groups and samples more prompts, round after round, until the batch holds `target_groups` groups with
reward variance or `max_rounds` rounds have run; then it trains on what there is (cut to whole optimizer
steps) and says so in the metrics.

With reward.overlong on, the advantages see reward + overlong penalty, so a group is flat only when its
penalties are equal too (SampledGroup.has_signal); DAPO's accuracy filter also drops equal rewards of
different lengths.

Everything is a function of (run seed, iteration, round) and the rewards, never of wall time or of which
worker ran a round, so a retried or resumed iteration draws exactly the same extra prompts:
- `extra_prompt_rows`: the dataset rows of round r >= 1, from a stream of its own (the main data order of
  engines/data.py, and so its cursor = iteration number, is untouched);
- `prompts_to_draw`: how many prompts the next round asks for;
- `select_groups`: which groups train, and the metrics.

The caller: stages/dynamic.py (the rollout stage's sampling rounds).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SampledGroup:
    """One prompt's group: its dataset row, the round that drew it (0 = the iteration's own prompts), its
    samples' scalar rewards (the reward sources', raw) and, when reward.overlong is on, their overlong
    penalties (engines.ppo.rewards.overlong_penalty), in sample order; penalties = () when it is off."""

    prompt_row: int
    round: int
    rewards: tuple[float, ...]
    penalties: tuple[float, ...] = ()

    def has_signal(self) -> bool:
        """False only when the update will give this group zero advantage whatever its running statistics:
        equal raw rewards (reward.normalize maps them to equal ones) and equal overlong penalties.

        A group of equal raw rewards but different lengths inside the penalty's ramp has a signal (shorter is
        better) and is kept. Not seen here: the KL in the reward (algo.kl_in_reward), known only in the update.
        """
        return has_reward_variance(self.rewards) or (bool(self.penalties) and has_reward_variance(self.penalties))


def has_reward_variance(rewards: Sequence[float], tol: float = 0.0) -> bool:
    """True when max - min > tol; a group of equal rewards (DAPO: accuracy 0 or 1) has none.

    ValueError for an empty group or a non-finite reward (naming it).
    """
    if not rewards:
        raise ValueError("has_reward_variance: empty group")
    bad = [r for r in rewards if not math.isfinite(r)]
    if bad:
        raise ValueError(f"has_reward_variance: non-finite rewards {bad[:3]}")
    return max(rewards) - min(rewards) > tol


def extra_prompt_rows(
    num_rows: int, seed: int, iteration: int, round_index: int, count: int, exclude: Collection[int] = ()
) -> list[int]:
    """`count` dataset rows for round `round_index` >= 1 of `iteration`, none of them in `exclude` (the rows
    the iteration has drawn already), in a fixed order of (seed, iteration, round_index).

    Fewer than `count` rows come back when fewer than `count` rows are left outside `exclude`.
    Raises ValueError for num_rows < 1, iteration < 0, round_index < 1 or count < 0.
    """
    if num_rows < 1 or iteration < 0 or round_index < 1 or count < 0:
        raise ValueError(
            f"extra_prompt_rows: need num_rows >= 1, iteration >= 0, round_index >= 1, count >= 0; "
            f"got {num_rows}, {iteration}, {round_index}, {count}"
        )
    excluded = set(exclude)
    candidates = [row for row in range(num_rows) if row not in excluded]
    random.Random(f"ppoflow-dynamic-sampling-{seed}-{iteration}-{round_index}").shuffle(candidates)
    return candidates[:count]


def prompts_to_draw(target_groups: int, kept_groups: int, sampled_groups: int, max_factor: float = 4.0) -> int:
    """Prompts the next round asks for: the shortfall, scaled up by the share of groups kept so far (so a
    round where half the groups had no variance asks for twice the shortfall), at most max_factor times it.

    0 when the batch is full. Deterministic: the inputs are counts. ValueError for negative counts or
    kept_groups > sampled_groups.
    """
    if min(target_groups, kept_groups, sampled_groups) < 0 or kept_groups > sampled_groups:
        raise ValueError(
            f"prompts_to_draw: bad counts target={target_groups} kept={kept_groups} sampled={sampled_groups}"
        )
    shortfall = target_groups - kept_groups
    if shortfall <= 0:
        return 0
    if kept_groups == 0:
        return math.ceil(shortfall * max_factor) if sampled_groups else shortfall
    return min(math.ceil(shortfall * sampled_groups / kept_groups), math.ceil(shortfall * max_factor))


@dataclass(frozen=True)
class GroupSelection:
    """groups: the groups to train on, in draw order. metrics: see select_groups."""

    groups: list[SampledGroup]
    metrics: dict[str, float]


def select_groups(
    groups: Sequence[SampledGroup], target_groups: int, groups_per_step: int, enabled: bool = True
) -> GroupSelection:
    """The groups an update trains on.

    A group "has variance" when SampledGroup.has_signal: its raw rewards, or its overlong penalties, differ.

    enabled: the first `target_groups` groups with reward variance, in draw order (round, then order within
    the round); when fewer exist (the rounds ran out) as many as fill whole optimizer steps of
    `groups_per_step` groups (train_batch_size / n_samples). When not even one step's worth has variance,
    the first step is topped up with zero-variance groups in draw order: the trainer needs whole steps, and
    such groups add no policy gradient under a group estimator (the update is then mostly its KL term);
    rollout/zero_variance_trained_fraction says how many. Disabled: the round-0 groups as they are.

    metrics (the rollout stage's, in the iteration's row):
        rollout/dynamic_rounds                    rounds that sampled (1 + the highest round seen)
        rollout/groups_kept                       groups trained on
        rollout/groups_dropped                    groups sampled but not trained on
        rollout/batch_filled                      1 when target_groups groups with variance train, else 0
        rollout/zero_variance_sampled_fraction    share of the sampled groups without variance
        rollout/zero_variance_trained_fraction    share of the trained groups without variance (0 unless topped up)

    Raises ValueError for target_groups < 1, groups_per_step < 1, or target_groups not a multiple of it.
    """
    if target_groups < 1 or groups_per_step < 1 or target_groups % groups_per_step:
        raise ValueError(
            f"select_groups: target_groups={target_groups} must be a positive multiple of "
            f"groups_per_step={groups_per_step}"
        )
    ordered = sorted(groups, key=lambda g: g.round)  # stable: keeps the order within a round
    varied = [g.has_signal() for g in ordered]
    if enabled:
        positions = [i for i, v in enumerate(varied) if v][:target_groups]
        if len(positions) < target_groups:
            positions = positions[: len(positions) - len(positions) % groups_per_step]
        if not positions:  # not one step with variance: top the first step up (see the docstring)
            flat_first = [i for i, v in enumerate(varied) if v] + [i for i, v in enumerate(varied) if not v]
            positions = sorted(flat_first[:groups_per_step])
        kept_at = positions
    else:
        kept_at = [i for i, g in enumerate(ordered) if g.round == 0]
    kept = [ordered[i] for i in kept_at]
    flat_kept = sum(not varied[i] for i in kept_at)
    metrics = {
        "rollout/dynamic_rounds": float(1 + max((g.round for g in ordered), default=0)),
        "rollout/groups_kept": float(len(kept)),
        "rollout/groups_dropped": float(len(ordered) - len(kept)),
        "rollout/batch_filled": float(len(kept) == target_groups and flat_kept == 0),
    }
    if ordered:
        metrics["rollout/zero_variance_sampled_fraction"] = varied.count(False) / len(ordered)
    if kept:
        metrics["rollout/zero_variance_trained_fraction"] = flat_kept / len(kept)
    return GroupSelection(kept, metrics)
