"""DAPO dynamic sampling inside the rollout stage: sample in rounds, keep only groups with reward variance.

"Reward variance" is on what the advantages will see, as far as the rollout stage can know it: the raw
rewards, and with reward.overlong the overlong penalty of each response's length (`overlong_penalties`, the
update's own formula on the same response_ids). A group of equal raw rewards but different penalties is
kept (SampledGroup.has_signal). reward.normalize is affine, so it keeps equal rewards equal.

    sample_dynamic(sample, source, cfg, iteration, rewards_of) -> (rollout rows, metrics)
    stage_rewards(cfg) -> rewards_of                 the score stage's scorer (and score cache) as a callable

Where the filter lives, and why here: the reward is the score stage's, but whether a round must draw more
prompts depends on it, and only the rollout stage can sample more. So the rollout stage scores each round's
candidate groups with the score stage's own scorer and cache (`score_rows`, stages/held.py's warm
scorer) and writes only the kept groups as its shards. The hand-offs keep their types and meanings: the
rollout shards are the rows to train on, the score stage scores them as ever (every kept pair is already
in the score cache, so it computes nothing again when score.cache is on), the update trains on all of its
input. The cost: a rollout worker with dynamic sampling on also loads the reward sources and the reference
(reference log-probs come with every score; the kept ones are the cached ones the score stage reads back).

Rounds (round 0 = the iteration's own prompts, rounds 1.. = extra prompts):
- round r >= 1 draws `prompts_to_draw(target, kept, sampled)` dataset rows, chosen by
  `extra_prompt_rows(rows, run.seed, iteration, r, ...)` among the rows not drawn yet this iteration; each
  row is sampled with its own seed (stages/rollout.py), so a retried or resumed stage draws the
  same prompts and the same samples, hence the same rows;
- it stops when `target` = prompts_per_iteration groups with variance are kept, when
  rollout.dynamic_sampling.max_rounds rounds ran, or when no undrawn row is left;
- `select_groups` (engines/ppo/dynamic_sampling.py) picks the groups and computes the metrics;
  `rollout/first_round_reward_mean` is the mean reward of round 0's samples: the iteration's own prompts,
  comparable with an unfiltered run's reward/mean (which, with the filter on, covers only the kept groups).
"""

from __future__ import annotations

from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import torch

from engines.data import PromptRecord, PromptSource
from engines.ppo.dynamic_sampling import SampledGroup, extra_prompt_rows, prompts_to_draw, select_groups
from engines.ppo.rewards import overlong_penalty

Sampler = Callable[[list[PromptRecord]], pa.Table]  # prompts -> rollout rows, n per prompt, by (prompt, sample)
RewardsOf = Callable[[pa.Table], list[float]]  # rollout rows -> the scalar reward of each row, row for row


def stage_rewards(cfg) -> RewardsOf:
    """Rewards of rollout rows as the score stage computes them: its warm scorer, through the score cache when
    score.cache is on (so the score stage reads the kept rows' scores back instead of computing them)."""
    from stages.held import score_cache_for, scorer_for
    from stages.score import score_rows
    from storage.layout import layout_for

    def rewards_of(table: pa.Table) -> list[float]:
        scorer = scorer_for(cfg)
        cache = score_cache_for(cfg, layout_for(cfg), scorer.identity) if cfg.score.cache else None
        scored, _ = score_rows(scorer, table, cache)
        return scored.column("reward").to_pylist()

    return rewards_of


def overlong_penalties(table: pa.Table, cfg) -> list[float]:
    """reward.overlong's penalty of each rollout row, row for row, as the update adds it to the reward (the
    length is the row's response_ids count, as in its response_mask); [] when reward.overlong is off."""
    overlong = cfg.reward.overlong
    if overlong is None:
        return []
    lengths = torch.tensor(pc.list_value_length(table.column("response_ids")).to_pylist())
    return overlong_penalty(lengths, cfg.rollout.max_new_tokens, overlong.buffer, overlong.penalty).tolist()


def sample_dynamic(
    sample: Sampler, source: PromptSource, cfg, iteration: int, rewards_of: RewardsOf
) -> tuple[pa.Table, dict[str, float]]:
    """The rollout rows of the kept groups (in draw order) and the rounds' metrics (see the module docstring).

    Raises ValueError when `sample` returns other than n rows per prompt or `rewards_of` other than one
    reward per row (naming the round).
    """
    n, seed = cfg.rollout.n_samples, cfg.run.seed
    target = cfg.rollout.prompts_per_iteration
    groups_per_step = (cfg.train.train_batch_size or cfg.rollout_batch_size) // n
    records = source.prompts_for_iteration(iteration, target, seed)
    tables: list[pa.Table] = []
    groups: list[SampledGroup] = []
    drawn: set[int] = set()
    kept = 0
    for round_index in range(cfg.rollout.dynamic_sampling.max_rounds):
        if round_index > 0:
            count = prompts_to_draw(target, kept, len(groups))
            rows = extra_prompt_rows(len(source), seed, iteration, round_index, count, exclude=drawn)
            if not rows:
                break
            records = source.records(rows)
        table = sample(records)
        rewards = rewards_of(table)
        penalties = overlong_penalties(table, cfg)
        if table.num_rows != len(records) * n or len(rewards) != table.num_rows:
            raise ValueError(
                f"dynamic sampling round {round_index} of iteration {iteration}: {len(records)} prompts x "
                f"n_samples={n} but {table.num_rows} rows and {len(rewards)} rewards"
            )
        if round_index == 0:  # the iteration's own prompts: what an unfiltered run's reward/mean measures
            first_round_mean = sum(rewards) / len(rewards)
        tables.append(table)
        for j, record in enumerate(records):
            rows = slice(j * n, (j + 1) * n)
            groups.append(SampledGroup(record.index, round_index, tuple(rewards[rows]), tuple(penalties[rows])))
        drawn.update(r.index for r in records)
        kept = min(target, sum(1 for g in groups if g.has_signal()))
        if kept >= target:
            break
    selection = select_groups(groups, target, groups_per_step)
    position = {id(g): i for i, g in enumerate(groups)}  # group i holds rows [i*n, (i+1)*n) of all rounds
    take = [position[id(g)] * n + s for g in selection.groups for s in range(n)]
    metrics = {**selection.metrics, "rollout/first_round_reward_mean": first_round_mean}
    return pa.concat_tables(tables).take(pa.array(take, pa.int64())), metrics
