"""wait_for_previous: an update is released by its predecessor's commit, not by the end of its slot, and raises
when the predecessor's slot ended without committing. Slots are PrefectConcurrentFutures over plain
concurrent futures whose result is the slot's final state, as Prefect's thread-pool task runner makes them."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

import pytest
from prefect.futures import PrefectConcurrentFuture
from prefect.states import Completed, Failed

from engines.toy.run_config import toy_config
from runtime.in_flight import PreviousIterationFailed, mark_committed, register_in_flight, wait_for_previous
from storage.layout import layout_for


@pytest.fixture
def cfg(tmp_path):
    return toy_config(tmp_path / "runs", "in-flight", tmp_path / "model", tmp_path / "data")


def _slot(cfg, iteration: int) -> concurrent.futures.Future:
    wrapped: concurrent.futures.Future = concurrent.futures.Future()
    register_in_flight(layout_for(cfg).run_dir, iteration, PrefectConcurrentFuture(uuid.uuid4(), wrapped))
    return wrapped


def _wait_in_thread(cfg, iteration: int) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def wait() -> None:
        try:
            wait_for_previous(cfg, iteration)
            out["returned"] = time.monotonic()
        except PreviousIterationFailed as e:
            out["error"] = e

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, out


def test_commit_releases_the_next_update_while_the_slot_still_runs(cfg):
    slot = _slot(cfg, 3)
    thread, out = _wait_in_thread(cfg, 4)
    thread.join(0.3)
    assert thread.is_alive(), "returned before iteration 3 committed"
    mark_committed(cfg, 3)
    thread.join(5)
    assert "returned" in out and not slot.done()  # released by the commit alone
    slot.set_result(Completed())
    register_in_flight(layout_for(cfg).run_dir, 3, None)


def test_a_slot_that_ends_without_a_commit_fails_the_next_update(cfg):
    slot = _slot(cfg, 5)
    thread, out = _wait_in_thread(cfg, 6)
    slot.set_result(Failed(message="reward function raised"))
    thread.join(5)
    assert isinstance(out.get("error"), PreviousIterationFailed)
    assert "iteration 5" in str(out["error"]) and "reward function raised" in str(out["error"])
    register_in_flight(layout_for(cfg).run_dir, 5, None)


def test_not_in_flight_returns_at_once(cfg):
    thread, out = _wait_in_thread(cfg, 9)
    thread.join(5)
    assert "returned" in out
