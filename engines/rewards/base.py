"""The reward-source interface. A source scores a batch of (prompt, response) pairs to one float each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


@dataclass
class RewardBatch:
    """Inputs of one reward call. All lists have the batch's length B.

    prompts / responses: decoded text; queries = prompt + response (OpenRLHF's `queries`).
    prompt_ids / response_ids: token ids (response without padding, EOS included when generated).
    labels: the dataset's label / ground truth per sample (None when the dataset has none).
    data_sources: veRL's data_source per sample (None when absent).
    sample_ids: how errors name a sample, e.g. "iter 3 prompt 12 sample 1".
    env_rewards: a multi-turn sample's summed environment reward (the rollout's env_reward), None for a
                 single-turn sample; empty when the caller has none.
    """

    prompts: list[str]
    responses: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    labels: list[Any]
    data_sources: list[Optional[str]] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    env_rewards: list[Optional[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def queries(self) -> list[str]:
        return [p + r for p, r in zip(self.prompts, self.responses)]


class RewardError(RuntimeError):
    """A reward source failed; the message names the source and the sample."""


class RewardSource(Protocol):
    """Scores batches. `identity` changes whenever its scores could change (weights, code, settings)."""

    name: str
    identity: str
    # The batch fields beyond the tokens and texts its scores depend on ("label", "data_source"); the score
    # cache keys on them. A source without this attribute is taken to read both.
    reward_inputs: tuple[str, ...]

    def score(self, batch: RewardBatch) -> list[float]:
        """Return B floats. Raises RewardError naming the sample; never returns a silent default."""
        ...
