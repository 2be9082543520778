"""adaptations/prefect_task_worker.py overrides a private method of Prefect's TaskWorker (prefect 3.7.7): this fails
when upstream's worker no longer has what the override builds on, before a warm worker silently misbehaves.
Its behaviour against a real server: tests/integration/test_worker_resubscribe.py, test_stage_workers.py."""

from __future__ import annotations

import inspect

import prefect
from prefect.task_worker import TaskWorker

from adaptations.prefect_task_worker import SlotTaskWorker


def test_written_against_the_pinned_prefect():
    assert prefect.__version__ == "3.7.7"  # pyproject.toml's pin: re-check the override before moving it


def test_upstream_still_has_the_parts_the_override_uses():
    # the method replaced, and the ones it calls on upstream's worker
    assert inspect.iscoroutinefunction(TaskWorker._subscribe_to_task_scheduling)
    assert inspect.iscoroutinefunction(TaskWorker._safe_submit_scheduled_task_run)
    assert inspect.iscoroutinefunction(TaskWorker._acquire_token)
    assert list(inspect.signature(TaskWorker._acquire_token).parameters) == ["self", "task_run_id"]
    # upstream's subscription loop is where it subscribes (so replacing it replaces the subscription)
    assert "Subscription(" in inspect.getsource(TaskWorker._subscribe_to_task_scheduling)
    # attributes made by upstream's __init__ / start that the override reads
    source = inspect.getsource(TaskWorker)
    for attribute in (
        "self._runs_task_group",
        "def available_tasks",
        "self.task_keys",
        "def client_id",
        "self._client",
    ):
        assert attribute in source, attribute


def test_the_override_is_what_runs():
    assert SlotTaskWorker._subscribe_to_task_scheduling is not TaskWorker._subscribe_to_task_scheduling
    worker_init = inspect.signature(SlotTaskWorker.__init__).parameters
    assert {"presence_keys", "presence_id", "after_run", "limit"} <= set(worker_init)
