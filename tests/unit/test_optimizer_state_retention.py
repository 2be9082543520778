"""Retention under train.optimizer_state_every = N > 1 (storage/checkpoints.apply_retention): besides the newest
run.keep_checkpoints, the newest checkpoint that holds the optimizer state stays, since a resume at a newer one
rebuilds the optimizer state from it (stages/update_replay.py). Checkpoints are small files committed through the
real protocol; which ones hold "optimizer state" is decided by the test, and the expected survivors are worked out
by hand from the rule."""

from __future__ import annotations

import os

import pytest

from storage.checkpoints import (
    checkpoint_iterations,
    commit_checkpoint,
    holds_optimizer_state,
    newest_with_optimizer_state,
    read_commit_marker,
    save_checkpoint_files,
)
from storage.layout import RunLayout


def _commit(layout: RunLayout, iteration: int, tmp_path, full: bool, keep_last: int = 2) -> None:
    local = tmp_path / f"staged-{iteration}"
    (local / "policy").mkdir(parents=True)
    (local / "trainer").mkdir()
    (local / "policy" / "model.safetensors").write_bytes(os.urandom(64))
    (local / "trainer" / "rng.safetensors").write_bytes(os.urandom(16))
    if full:
        (local / "trainer" / "actor_optimizer.safetensors").write_bytes(os.urandom(128))
    save_checkpoint_files(layout, iteration, str(local))
    commit_checkpoint(layout, iteration, keep_last=keep_last)


def _kept(layout: RunLayout) -> list[int]:
    return [i for i, ok in checkpoint_iterations(layout).items() if ok]


def test_the_newest_checkpoint_with_optimizer_state_outlives_keep_checkpoints(tmp_path):
    layout = RunLayout(str(tmp_path / "runs"), "every-3")
    # N = 3 over 7 iterations: 3 and 6 hold the optimizer state; keep_checkpoints = 2.
    expected = {1: [1], 2: [1, 2], 3: [2, 3], 4: [3, 4], 5: [3, 4, 5], 6: [5, 6], 7: [6, 7]}
    for iteration in range(1, 8):
        _commit(layout, iteration, tmp_path, full=iteration % 3 == 0)
        assert _kept(layout) == expected[iteration], iteration
    assert holds_optimizer_state(read_commit_marker(layout, 6))
    assert not holds_optimizer_state(read_commit_marker(layout, 7))
    assert newest_with_optimizer_state(layout, range(1, 8)) == 6
    assert newest_with_optimizer_state(layout, range(7, 8)) is None


@pytest.mark.parametrize("full", [True, False])
def test_with_every_checkpoint_alike_retention_is_keep_checkpoints(tmp_path, full):
    """N = 1 (every checkpoint holds it) and checkpoints that hold none (a reward model's): the newest two stay."""
    layout = RunLayout(str(tmp_path / "runs"), "alike")
    for iteration in range(1, 6):
        _commit(layout, iteration, tmp_path, full=full)
    assert _kept(layout) == [4, 5]
