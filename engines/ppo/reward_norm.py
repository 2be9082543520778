"""Running reward normalisation (`reward.normalize: running`): r -> (r - mean) / (std + eps).

mean and std are those of every reward the trainer has seen so far, this batch included, merged batch by
batch with the parallel form of Welford's algorithm (Chan, Golub & LeVeque 1979): for the moments
(n_a, mean_a, M2_a) so far and (n_b, mean_b, M2_b) of the new batch,
    n = n_a + n_b,  delta = mean_b - mean_a,
    mean = mean_a + delta * n_b / n,  M2 = M2_a + M2_b + delta^2 * n_a * n_b / n,  var = M2 / n.
This is exact (up to float64 rounding) whatever the batch sizes, and needs no stored rewards. The state is
three floats (state_dict), saved in the trainer state (trainer.json) and restored on resume, so a resumed
run normalises exactly like an uninterrupted one. OpenRLHF and trlx keep the same running moments.

The batch is merged BEFORE it is normalised: the first batch is normalised by its own moments rather than
by an empty history.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from engines.ppo._checks import check_rank


class RunningMoments:
    """Running count, mean and sum of squared deviations (M2) of scalar rewards, in float64."""

    def __init__(self, eps: float = 1e-8):
        self.eps = eps
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        """Population variance (divides by the count); 0 before any update."""
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, rewards: Tensor) -> None:
        """Merge a batch of rewards, shape (B,). ValueError for an empty or non-finite batch (it would poison
        every later batch's statistics)."""
        check_rank("rewards", rewards, 1, "(B,)")
        if rewards.numel() == 0:
            raise ValueError("RunningMoments.update: empty reward batch")
        batch = rewards.detach().double().cpu()
        if not bool(torch.isfinite(batch).all()):
            raise ValueError(f"RunningMoments.update: non-finite rewards {batch[~torch.isfinite(batch)].tolist()[:5]}")
        n_b = float(batch.numel())
        mean_b = float(batch.mean())
        m2_b = float((batch - mean_b).square().sum())
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.count * n_b / n
        self.count = n

    def normalize(self, rewards: Tensor) -> Tensor:
        """(rewards - mean) / (std + eps), same shape and dtype. RuntimeError before the first update."""
        if not self.count:
            raise RuntimeError("RunningMoments.normalize before any update: no statistics yet")
        return ((rewards.double() - self.mean) / (self.std + self.eps)).to(rewards.dtype)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore state_dict(); ValueError naming a missing key or a negative count / M2."""
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            raise ValueError(f"reward normaliser state lacks {sorted(missing)}")
        if state["count"] < 0 or state["m2"] < 0:
            raise ValueError(f"reward normaliser state has a negative count or M2: {state}")
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
