"""metrics.jsonl: one line per iteration in iteration order, a retried iteration's line replaced, on a local
disk and on S3; locally the next iteration is appended (the file is not rewritten), and a torn append
(a crash in the middle of one) is skipped by readers and repaired by the next write."""

from __future__ import annotations

import json
import os

import pytest

from flows.records import read_metrics, record_metrics
from storage.fs import is_local
from storage.layout import RunLayout


@pytest.fixture
def layout(storage_root):
    root, cfg = storage_root
    return RunLayout(root, "run-m", cfg)


def _row(iteration: int, reward: float) -> dict:
    return {"iteration": iteration, "reward/mean": reward, "timing/update": 0.5 * iteration}


def test_rows_in_iteration_order_and_a_retried_iteration_replaced(layout):
    for iteration in (1, 2, 3, 4):
        record_metrics(layout, _row(iteration, 0.1 * iteration))
    record_metrics(layout, _row(3, 9.0))  # iteration 3 ran again (a retry)
    record_metrics(layout, _row(5, 0.5))
    record_metrics(layout, _row(0, -1.0))  # out of order: sorted in
    expected = [_row(0, -1.0), _row(1, 0.1), _row(2, 0.2), _row(3, 9.0), _row(4, 0.4), _row(5, 0.5)]
    assert read_metrics(layout) == expected
    with layout.fs.open(layout.metrics_path, "rb") as f:  # the file itself: JSON lines, one per row
        assert [json.loads(line) for line in f.read().decode().splitlines()] == expected


def test_a_local_run_appends_the_next_iteration_and_survives_a_torn_append(layout):
    if not is_local(layout.fs):
        pytest.skip("object storage has no append: every record is a whole-object PUT")
    record_metrics(layout, _row(1, 0.1))
    inode = os.stat(layout.metrics_path).st_ino
    record_metrics(layout, _row(2, 0.2))
    record_metrics(layout, _row(3, 0.3))
    # Appended in place: an atomic rewrite would have replaced the file (a new inode).
    assert os.stat(layout.metrics_path).st_ino == inode
    with open(layout.metrics_path, "ab") as f:  # a crash in the middle of appending iteration 4
        f.write(json.dumps(_row(4, 0.4)).encode()[:17])
    assert read_metrics(layout) == [_row(1, 0.1), _row(2, 0.2), _row(3, 0.3)]
    record_metrics(layout, _row(4, 0.4))  # the retried iteration 4 writes its row again
    assert read_metrics(layout) == [_row(1, 0.1), _row(2, 0.2), _row(3, 0.3), _row(4, 0.4)]
    with open(layout.metrics_path, "rb") as f:
        assert f.read().count(b"\n") == 4  # the torn bytes are gone, not left inside a line
    before = os.stat(layout.metrics_path).st_ino
    record_metrics(layout, _row(2, 2.0))  # a retry of an earlier iteration rewrites the file
    # (a new file, made while the old one still existed, so it cannot have been given the old inode)
    assert os.stat(layout.metrics_path).st_ino != before
    assert [r["reward/mean"] for r in read_metrics(layout)] == [0.1, 2.0, 0.3, 0.4]


def test_rows_whose_iteration_is_not_first_are_still_placed(layout):
    record_metrics(layout, _row(2, 0.2))
    record_metrics(layout, {"reward/mean": 0.1, "iteration": 1})  # key order of a hand-written row
    record_metrics(layout, {"reward/mean": 0.3, "iteration": 3})
    record_metrics(layout, {"reward/mean": 1.0, "iteration": 1})
    assert [(r["iteration"], r["reward/mean"]) for r in read_metrics(layout)] == [(1, 1.0), (2, 0.2), (3, 0.3)]
