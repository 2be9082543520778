"""flows/pipeline.run_pipelined: when the next iteration is submitted, and what a failed one stops.

The iteration slots are stood in for from outside (`iteration_slot` replaced by the test) with
PrefectConcurrentFutures over plain futures, as Prefect's thread-pool task runner makes them; each fake slot
commits at once (flows/in_flight.mark_committed, as ppo_iteration does after its checkpoint stage), then holds
its tail (metrics row, artifacts, subflow end) until the test lets it end."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

from prefect.futures import PrefectConcurrentFuture
from prefect.states import Completed

import flows.pipeline as pipeline
from engines.toy.run_config import toy_config
from flows.in_flight import mark_committed


class _Slots:
    """Stands in for `iteration_slot`: records submissions; iteration i commits, then waits for tails[i]."""

    def __init__(self, cfg, iterations: int, fail_before_commit: int = 0):
        self.cfg = cfg
        self.fail = fail_before_commit
        self.submitted: list[int] = []
        self.tails = {i: threading.Event() for i in range(1, iterations + 1)}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=iterations)

    def _body(self, iteration: int):
        if iteration == self.fail:
            raise RuntimeError(f"iteration {iteration}: reward function raised")
        mark_committed(self.cfg, iteration)
        self.tails[iteration].wait(20)
        return Completed(data={"iteration": iteration})

    def submit(self, config, iteration: int) -> PrefectConcurrentFuture:
        self.submitted.append(iteration)
        return PrefectConcurrentFuture(uuid.uuid4(), self.pool.submit(self._body, iteration))


def _config(tmp_path, iterations: int, k: int):
    return toy_config(
        tmp_path / "runs",
        "pipelined",
        tmp_path / "model",
        tmp_path / "data",
        iterations=iterations,
        sections={"pipeline": {"max_staleness": k}},
    )


def _run_in_thread(cfg, out: dict) -> threading.Thread:
    rows: list[int] = []
    out["rows"] = rows

    def run() -> None:
        try:
            pipeline.run_pipelined(cfg, 1, lambda row: rows.append(row["iteration"]))
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_the_next_iteration_starts_at_the_commit_of_the_one_it_samples_not_at_its_slot_end(tmp_path, monkeypatch):
    cfg = _config(tmp_path, iterations=4, k=1)
    slots = _Slots(cfg, 4)
    monkeypatch.setattr(pipeline, "iteration_slot", slots)
    out: dict = {}
    thread = _run_in_thread(cfg, out)

    # k = 1: two uncommitted at most. Iteration 3 samples the policy 1 committed, so it starts once 1 commits,
    # while 1's tail still runs (its tail is never released before this check)
    assert _wait_until(lambda: 3 in slots.submitted), f"submitted {slots.submitted} while iteration 1's tail ran"
    assert not slots.tails[1].is_set() and out["rows"] == []
    assert _wait_until(lambda: 4 in slots.submitted)  # 2 committed too
    for i in (1, 2, 3, 4):
        slots.tails[i].set()
    thread.join(20)
    assert not thread.is_alive() and "error" not in out
    assert out["rows"] == [1, 2, 3, 4] and slots.submitted == [1, 2, 3, 4]


def test_a_slot_that_ends_without_commit_raises_after_the_rows_before_it(tmp_path, monkeypatch):
    cfg = _config(tmp_path, iterations=5, k=1)
    slots = _Slots(cfg, 5, fail_before_commit=2)
    monkeypatch.setattr(pipeline, "iteration_slot", slots)
    for event in slots.tails.values():
        event.set()
    out: dict = {}
    thread = _run_in_thread(cfg, out)
    thread.join(20)
    assert not thread.is_alive()
    assert "iteration 2: reward function raised" in str(out.get("error"))
    assert out["rows"] == [1]
    # 3 samples the policy 1 committed and may have started (the failure may be seen first); 4 would sample
    # the policy of 2, which never came
    assert slots.submitted[:2] == [1, 2] and 4 not in slots.submitted
