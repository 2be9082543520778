"""The one retry rule (tasks/retries.py), by Prefect's own task engine on the loopback server: a task configured as a
warm worker serves it (`worker_options`, no run known in advance) makes exactly as many attempts as one configured
from the run's config in the flow's process (`retry_options`), and waits the same delays.

Expected values by hand: pipeline.retries = r gives 1 + r attempts, so a body failing its first f attempts succeeds
when f <= r and fails with f > r; the waits are retry_delay_s, 2 * retry_delay_s, ...
"""

from __future__ import annotations

import time

import pytest

from tasks.retries import retry_delays

FAILURES = 2  # the body fails its first two attempts


def _config(tmp_path, retries: int, delay_s: float):
    from engines.toy.run_config import toy_config

    sections = {"pipeline": {"retries": retries, "retry_delay_s": delay_s}}
    return toy_config(tmp_path / "runs", f"retries-{retries}", tmp_path / "m", tmp_path / "d", sections=sections)


def _attempts(cfg, options: dict) -> tuple[bool, list[float]]:
    """Run a task named "score" (config, iteration) failing its first FAILURES attempts, with `options`, in a flow:
    whether it completed, and the times of its attempts."""
    from prefect import flow, task

    times: list[float] = []

    @task(name="score", persist_result=False)
    def body(config: dict, iteration: int) -> int:
        times.append(time.monotonic())
        if len(times) <= FAILURES:
            raise RuntimeError(f"attempt {len(times)} fails")
        return len(times)

    @flow
    def one_stage() -> bool:
        return body.with_options(**options)(cfg.model_dump(mode="json"), 1, return_state=True).is_completed()

    return one_stage(), times


@pytest.mark.parametrize("retries", [1, 2])
def test_a_worker_retries_as_the_runs_config_says_and_as_in_process(prefect_api, tmp_path, retries):
    from tasks.retries import retry_options, worker_options

    cfg = _config(tmp_path, retries, 0.2)
    for options in (retry_options(cfg), worker_options()):
        completed, times = _attempts(cfg, options)
        assert completed == (FAILURES <= retries)
        assert len(times) == min(FAILURES, retries) + 1
        waits = [b - a for a, b in zip(times, times[1:])]
        for wait, delay in zip(waits, [0.2, 0.4]):
            assert delay <= wait < delay + 5.0  # the machine may be slow, never early


def test_delays_double_from_retry_delay_s(tmp_path):
    assert retry_delays(_config(tmp_path, 3, 1.5)) == [1.5, 3.0, 6.0]
    assert retry_delays(_config(tmp_path, 0, 1.5)) == []
