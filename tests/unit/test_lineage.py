"""Forks at the storage level (storage/lineage.py, storage/checkpoints.py, flows/fork.py), without training:
checkpoints are small files committed through the real protocol.

A reference reads as its owner's commit and loads from the owner's folder; the owner's retention keeps what a
fork pins; the fork's retention removes only its reference and unpins it; a change that cannot cross a fork is
refused naming the field, before anything is written.
"""

from __future__ import annotations

import os

import pytest

from flows.fork import ForkError, fork_config, fork_run
from storage import lineage
from storage.checkpoints import (
    apply_retention,
    checkpoint_iterations,
    commit_checkpoint,
    latest_iteration,
    load_checkpoint,
    read_commit_marker,
    save_checkpoint_files,
)
from storage.layout import RunLayout, layout_for
from storage.run_identity import new_run_record, read_run_record, write_run_record
from tests.integration.pipeline_helpers import small_config


def _commit(layout: RunLayout, iteration: int, tmp_path, keep_last: int = 10) -> dict:
    local = tmp_path / f"{layout.run_name}-{iteration}"
    (local / "policy").mkdir(parents=True)
    (local / "policy" / "weights.bin").write_bytes(os.urandom(64) + bytes([iteration]))
    save_checkpoint_files(layout, iteration, str(local))
    return commit_checkpoint(layout, iteration, keep_last=keep_last)


def _parent(tmp_path, iterations_committed: int = 2, **sections):
    cfg = small_config(str(tmp_path / "root"), "base", tmp_path / "model", tmp_path / "data", iterations=4, **sections)
    layout = layout_for(cfg)
    layout.write_config_once(cfg.to_yaml())
    write_run_record(layout, new_run_record({}))
    for iteration in range(1, iterations_committed + 1):
        _commit(layout, iteration, tmp_path)
    return cfg, layout


def test_a_reference_reads_and_loads_as_the_owners_checkpoint(tmp_path):
    _, parent = _parent(tmp_path)
    child = RunLayout(parent.root_url, "child")
    lineage.pin(parent, child, 2, [2])
    lineage.write_reference(child, parent, 2)

    assert read_commit_marker(child, 2) == read_commit_marker(parent, 2)
    assert read_commit_marker(child, 1) is None  # only what is referenced
    assert latest_iteration(child) == 2
    assert checkpoint_iterations(child) == {2: True}
    assert load_checkpoint(child, 2) == parent.checkpoint_dir(2)  # the owner's files, verified in place
    assert os.listdir(child.checkpoint_dir(2)) == [lineage.REFERENCE_NAME]


def test_the_owners_retention_keeps_what_a_fork_pins_and_the_forks_retention_unpins(tmp_path):
    _, parent = _parent(tmp_path)
    child = RunLayout(parent.root_url, "child")
    lineage.pin(parent, child, 2, [2])
    lineage.write_reference(child, parent, 2)

    _commit(parent, 3, tmp_path, keep_last=1)
    _commit(parent, 4, tmp_path, keep_last=1)
    assert checkpoint_iterations(parent) == {2: True, 4: True}  # 1 and 3 removed, 2 pinned

    _commit(child, 3, tmp_path, keep_last=1)  # the fork moves on: its reference to 2 goes, then the pin
    assert checkpoint_iterations(child) == {3: True}
    assert lineage.pinned_iterations(parent) == set()
    assert os.path.isfile(os.path.join(parent.checkpoint_dir(2), "policy", "weights.bin"))  # the owner's files stay
    assert apply_retention(parent, 1) == [2]  # no longer pinned: the owner's retention may take it now


def test_an_unreadable_fork_record_stops_retention(tmp_path):
    _, parent = _parent(tmp_path, iterations_committed=3)
    os.makedirs(os.path.join(parent.run_dir, lineage.FORKS_DIR))
    with open(lineage.fork_record_path(parent, "broken"), "w") as f:
        f.write("{not json")
    assert apply_retention(parent, 1) == []
    assert sorted(checkpoint_iterations(parent)) == [1, 2, 3]


@pytest.mark.parametrize(
    "override, field",
    [
        ("run.seed=7", "run.seed"),
        ("data.path=/elsewhere", "data.path"),
        ("model.policy_path=/other-model", "model.policy_path"),
        ("model.lora={rank: 4}", "model.lora"),
        ("algo.name=grpo", "algo.name"),  # the checkpoint has a critic, GRPO trains none
        ("train.zero_stage=0", "train.zero_stage"),  # checkpoint N's optimizer state is partitioned for stage 2
    ],
)
def test_a_change_that_cannot_cross_a_fork_is_refused_naming_the_field(tmp_path, override, field):
    cfg, _ = _parent(tmp_path)
    with pytest.raises(ForkError, match=field.replace(".", r"\.")):
        fork_config(cfg, "child", [override])


def test_fork_run_writes_references_and_lineage_and_nothing_else(tmp_path):
    cfg, parent = _parent(tmp_path)
    fork = fork_run(parent.root_url, "base", 2, "child", ["algo.kl_coef=0.5", "train.ppo_epochs=2"])
    assert (fork.run.name, fork.algo.kl_coef, fork.train.ppo_epochs, fork.run.seed) == ("child", 0.5, 2, cfg.run.seed)
    child = layout_for(fork)
    assert read_run_record(child)["parent"] == {
        "run": "base",
        "root": parent.root,
        "iteration": 2,
        "run_id": read_run_record(parent)["run_id"],
    }
    assert read_run_record(child)["run_id"] != read_run_record(parent)["run_id"]
    assert latest_iteration(child) == 2 and lineage.own_first_iteration(child) == 3
    assert lineage.pinned_iterations(parent) == {2}
    files = sorted(
        os.path.relpath(os.path.join(d, n), child.run_dir) for d, _, ns in os.walk(child.run_dir) for n in ns
    )
    assert files == ["LATEST", "checkpoints/iter-000002/_REFERENCE.json", "config.yaml", "run.json"]

    again = fork_run(parent.root_url, "base", 2, "child", ["algo.kl_coef=0.5", "train.ppo_epochs=2"])
    assert again == fork  # the same fork again: nothing changes

    from cli.runs_view import lineage_lines

    assert lineage_lines(child)[0][0] == "forked from" and "base at iteration 2" in lineage_lines(child)[0][1]
    assert "child at iteration 2" in lineage_lines(parent)[0][1]


def test_fork_run_refuses_before_writing(tmp_path):
    _, parent = _parent(tmp_path)
    with pytest.raises(ForkError, match="--at 3"):
        fork_run(parent.root_url, "base", 3, "child")
    with pytest.raises(ForkError, match="run.seed"):
        fork_run(parent.root_url, "base", 2, "child", ["run.seed=9"])
    with pytest.raises(ForkError, match="run.iterations"):
        fork_run(parent.root_url, "base", 2, "child", ["run.iterations=2"])
    apply_retention(parent, 1)  # checkpoint 1 goes
    with pytest.raises(ForkError, match="checkpoint 1 of run 'base' is not there"):
        fork_run(parent.root_url, "base", 1, "child")
    with pytest.raises(ForkError, match="max_staleness"):  # iteration 3 would sample with checkpoint 1
        fork_run(parent.root_url, "base", 2, "child", ["pipeline.max_staleness=1"])
    assert not os.path.exists(os.path.join(parent.root, "child"))
    write_run_record(RunLayout(parent.root_url, "other"), new_run_record({}))  # a run that is no fork
    with pytest.raises(ForkError, match="is not this fork"):
        fork_run(parent.root_url, "base", 2, "other")
    with pytest.raises(ForkError, match="a name of its own"):
        fork_run(parent.root_url, "base", 2, "base")


def _rows(layout: RunLayout, rewards: dict[int, float]) -> None:
    from flows.records import record_metrics

    for iteration, reward in rewards.items():
        row = {"iteration": iteration, "reward/mean": reward, "kl/mean": reward / 10, "timing/update": 1.0}
        record_metrics(layout, row)


def test_the_plot_and_tensorboard_draw_a_fork_from_its_fork_point_beside_its_parent(tmp_path):
    """Parent rows 1..3 (reward 1, 2, 3), a fork at 2 with rows 3..4 (reward 30, 40): the fork's curve is the parent's
    row 2 and then its own; the parent's plot draws the fork the same way; the fork's TensorBoard events start at
    step 2 with the parent's value there. Read back from the PNG's drawing calls and tensorboard's reader."""
    from tensorboard.backend.event_processing import event_accumulator

    from cli.plot import lineage_curves, plot_run
    from flows import tracker
    from storage.metrics import read_metrics

    cfg, parent = _parent(tmp_path, iterations_committed=2)
    tracker.close_trackers()
    _rows(parent, {1: 1.0, 2: 2.0, 3: 3.0})
    fork = layout_for(fork_run(cfg.run.root, "base", 2, "child", []))
    _rows(fork, {3: 30.0, 4: 40.0})
    tracker.close_trackers()

    rows, beside = lineage_curves(fork, read_metrics)
    assert [(r["iteration"], r["reward/mean"]) for r in rows] == [(2, 2.0), (3, 30.0), (4, 40.0)]
    assert [(label, [r["iteration"] for r in curve]) for label, curve in beside] == [("parent base", [1, 2, 3])]
    rows, beside = lineage_curves(parent, read_metrics)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert [(label, [(r["iteration"], r["reward/mean"]) for r in curve]) for label, curve in beside] == [
        ("fork child", [(2, 2.0), (3, 30.0), (4, 40.0)])
    ]
    out = plot_run(cfg.run.root, "child", str(tmp_path / "child.png"))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    acc = event_accumulator.EventAccumulator(os.path.join(fork.run_dir, "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(2, 2.0), (3, 30.0), (4, 40.0)]
