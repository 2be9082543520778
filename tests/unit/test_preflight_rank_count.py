"""Preflight refuses, before any work, a resume whose latest checkpoint was saved by a rank count the run cannot
load (flows/preflight.rank_count_problems), also with train.num_ranks = 1; a count it can re-cut passes. The
checkpoint is committed through storage.checkpoints with a trainer/ folder as save_trainer writes it."""

import json

import pytest

from flows.preflight import rank_count_problems
from ppoflow.config import load_config
from storage.checkpoints import commit_checkpoint, save_checkpoint_files
from storage.layout import layout_for


def _run_with_checkpoint(tmp_path, saved_world: int, saved_stage: int, run_stage: int, run_ranks: int):
    cfg = load_config(
        None,
        [f"run.root={tmp_path / 'runs'}", "run.name=r"]
        + [f"train.zero_stage={run_stage}", f"train.num_ranks={run_ranks}"],
    )
    saved = load_config(None, [f"train.zero_stage={saved_stage}"])
    trainer = tmp_path / "scratch" / "trainer"
    trainer.mkdir(parents=True)
    (trainer / "trainer.json").write_text(json.dumps({"update_count": 1, "world_size": saved_world}))
    (trainer / "config.json").write_text(json.dumps(saved.model_dump(mode="json")))
    layout = layout_for(cfg)
    save_checkpoint_files(layout, 1, str(tmp_path / "scratch"))
    commit_checkpoint(layout, 1)
    return cfg


def test_a_new_run_has_nothing_to_check(tmp_path):
    assert rank_count_problems(load_config(None, [f"run.root={tmp_path}", "run.name=fresh"])) == []


@pytest.mark.parametrize("run_ranks", [1, 4])
def test_zero3_saved_by_two_ranks_is_refused_naming_both_counts(tmp_path, run_ranks):
    cfg = _run_with_checkpoint(tmp_path, saved_world=2, saved_stage=3, run_stage=3, run_ranks=run_ranks)
    (problem,) = rank_count_problems(cfg)
    assert problem.startswith("train.num_ranks: ")
    assert f"saved by 2 rank(s) but train.num_ranks={run_ranks}" in problem and "set train.num_ranks=2" in problem


def test_zero2_saved_by_two_ranks_resumes_on_one(tmp_path):
    assert rank_count_problems(_run_with_checkpoint(tmp_path, 2, saved_stage=2, run_stage=2, run_ranks=1)) == []
