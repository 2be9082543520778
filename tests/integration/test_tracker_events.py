"""TensorBoard events written from record_metrics: a resumed run shows each iteration once, and a run on S3
gets its event files in the bucket. Read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

import time

import pytest

from flows import tracker
from flows.records import record_metrics
from storage.layout import RunLayout


def _scalars(logdir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _row(iteration: int, reward: float) -> dict:
    return {
        "iteration": iteration,
        "reward/mean": reward,
        "kl/mean": None,
        "rollout/engine": "hf",
        "timing/update": 0.5,
        "flag": True,
    }


def test_a_resumed_run_replaces_the_iterations_it_writes_again(tmp_path):
    layout = RunLayout(str(tmp_path), "resumed")
    for i in range(1, 5):
        record_metrics(layout, _row(i, i / 8))  # eighths: exact in float32
    tracker.close_trackers()  # the process ends (a crash after iteration 4's row, before its commit)
    time.sleep(1.1)  # event file names carry the second they were opened in: the resume's file sorts after
    for i in range(4, 7):
        record_metrics(layout, _row(i, 10 + i / 8))  # the resumed process writes iterations 4..6
    tracker.close_trackers()
    logdir = str(tmp_path / "resumed" / "tensorboard")
    assert _scalars(logdir, "reward/mean") == [(1, 0.125), (2, 0.25), (3, 0.375), (4, 10.5), (5, 10.625), (6, 10.75)]
    assert _scalars(logdir, "timing/update") == [(i, 0.5) for i in range(1, 7)]


def test_only_numeric_metrics_become_scalars(tmp_path):
    layout = RunLayout(str(tmp_path), "kinds")
    record_metrics(layout, _row(1, 0.5))
    tracker.close_trackers()
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(tmp_path / "kinds" / "tensorboard"))
    acc.Reload()
    # None (kl/mean), a string (rollout/engine) and a bool (flag) are not measured values: left out.
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "timing/update"}


@pytest.mark.slow
def test_an_s3_run_gets_its_event_files_in_the_bucket(s3_bucket, tmp_path, monkeypatch):
    bucket, storage_cfg = s3_bucket
    monkeypatch.setenv("PPOFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tracker, "_ROWS_PER_FILE", 2)  # rows 1-2 in one file, row 3 in the next
    layout = RunLayout(f"s3://{bucket}/runs", "remote", storage_cfg)
    for i in range(1, 4):
        record_metrics(layout, _row(i, i / 4))
    tracker.close_trackers()
    remote = f"{bucket}/runs/remote/tensorboard"
    names = [p.rsplit("/", 1)[-1] for p in layout.fs.ls(remote, detail=False)]
    assert len(names) == 2 and all(n.startswith("events.out.tfevents.") for n in names)
    copy = tmp_path / "downloaded"
    copy.mkdir()
    for name in names:
        (copy / name).write_bytes(layout.fs.cat_file(f"{remote}/{name}"))
    assert _scalars(str(copy), "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    # The local mirror the writer appends to sits under the cache folder, named after the root.
    assert str(tmp_path / "cache" / "mirror") in tracker.tensorboard_dir_for(layout)
