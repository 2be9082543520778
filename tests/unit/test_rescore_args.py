"""`ppoflow rescore --set` changes reward.* and score.* fields only, as its help says (issue 56)."""

from __future__ import annotations

import pytest

from cli.main import main
from flows.fork import ForkError
from flows.rescore import rescore_fork


def test_a_field_outside_reward_and_score_is_refused_with_the_fork_that_does_it(tmp_path, capsys):
    # Before: `--set algo.kl_coef=0.5` was accepted, and the rescore trained iteration K with it.
    with pytest.raises(ForkError) as refused:
        rescore_fork(str(tmp_path), "base", 3, "kl", ["reward.clip=5", "algo.kl_coef=0.5"])
    text = str(refused.value)
    assert text.startswith("--set algo.kl_coef=0.5: rescore changes how iteration 3's saved rollouts are scored")
    assert text.endswith("ppoflow fork base --at 2 --name kl --replay 1 --set algo.kl_coef=0.5")
    assert list(tmp_path.iterdir()) == []  # refused before anything was read or written
    argv = ["rescore", "base", "--iteration", "3", "--name", "kl", "--root", str(tmp_path), "--set", "run.seed=1"]
    assert main(argv) == 2
    assert "ppoflow: error: --set run.seed=1: rescore changes how" in capsys.readouterr().err


def test_a_reward_field_goes_on_to_the_fork(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run 'base'"):  # past the check: the parent run is looked up
        rescore_fork(str(tmp_path), "base", 3, "clip", ["reward.clip=5", "score.cache=false"])
