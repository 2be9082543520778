"""The environment's reward as a reward source: reward.sources entry `{kind: environment, weight: w}`.

A multi-turn rollout (rollout.environment, engines/rollout/multi_turn.py) records each sample's summed
environment reward in the shards' `env_reward` column; this source hands it to the scorer, which sums it with
the other sources by weight and clips, like any source. It computes nothing and reads no model.

Caching: the score cache keys on env_reward (`reward_inputs`), so two samples with the same tokens but different
environment rewards never share an entry. Errors: a sample without an env_reward (a single-turn row) is a
RewardError naming the sample; the config refuses the source without rollout.environment before that.
"""

from __future__ import annotations

from engines.rewards.base import RewardBatch, RewardError


class EnvironmentRewardSource:
    """RewardSource returning each sample's env_reward."""

    reward_inputs = ("env_reward",)

    def __init__(self, name: str = "environment"):
        self.name = name
        self.identity = "environment-reward-v1"  # the reward comes with the rows: no code or weights behind it

    def score(self, batch: RewardBatch) -> list[float]:
        """(B,) floats: batch.env_rewards. RewardError naming the first sample that has none."""
        rewards = list(batch.env_rewards) or [None] * len(batch)
        for i, value in enumerate(rewards):
            if value is None:
                name = batch.sample_ids[i] if i < len(batch.sample_ids) else f"sample {i}"
                raise RewardError(
                    f"reward source {self.name!r}: {name} has no env_reward (it was not sampled by a multi-turn "
                    f"rollout; set rollout.environment or drop this source)"
                )
        return [float(v) for v in rewards]

    def close(self) -> None:
        pass
