"""Prefect's task worker, changed to take a task run only while it has a free slot (`SlotTaskWorker`).

Written against prefect 3.7.7 (pinned). It overrides `TaskWorker._subscribe_to_task_scheduling`, a private
method: tests/unit/test_adaptations_prefect_task_worker.py fails when upstream's worker no longer has the parts it
builds on (that method, `_runs_task_group`, `available_tasks`, `_acquire_token`, `_safe_submit_scheduled_task_run`,
`task_keys`, `client_id`, `_client`), and tests/integration/test_worker_resubscribe.py runs it against a real server.

What upstream does: its worker stays subscribed while busy, and the server hands it the next run at once (it waits
in the worker until the slot frees), so of two idle-looking workers a busy one could take the second part of a split
rollout while the other sat idle. Here the worker subscribes only with a free slot and takes one task run per
subscription: closing the subscription with the run received makes the server put a run it was handing over back
into its queue, for a worker with a free slot. A handshake that times out or a dropped connection ends upstream's
worker; here the worker subscribes again after a growing wait (_RESUBSCRIBE_S), each failure logged.

Two more things it does, each given by the caller (the floor that knows what they mean: runtime/workers.py):
- `presence_keys` / `presence_id`: a second subscription, on presence keys, held for as long as the worker runs,
  so that a submitting flow can tell a busy worker from none;
- `after_run`: called after each task run (the update worker ends its process there when its torchrun group broke).
It also drops, unrun, a task run that was cancelled while it waited in the server's queue.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable

import httpx
from prefect.client.schemas.objects import TaskRun
from prefect.client.subscriptions import Subscription
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings
from prefect.task_worker import TaskWorker
from prefect.task_worker import logger as task_worker_logger
from websockets.exceptions import ConnectionClosed, InvalidHandshake

_SLOT_POLL_S = 0.05  # how soon a worker whose slot freed subscribes again
# OSError includes TimeoutError (the handshake's); a refused or dropped handshake, a close while waiting
_SUBSCRIBE_ERRORS = (OSError, InvalidHandshake, ConnectionClosed)
_RESUBSCRIBE_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # waits after failed subscriptions in a row (the last one repeats)


class SlotTaskWorker(TaskWorker):
    """Prefect's TaskWorker that takes a task run only while it has a free slot (see the module docstring).

    presence_keys: the task keys served -> the keys of the presence subscription; presence_id: its client id (not
    the work subscription's: the server forgets a client id when that subscription closes); after_run: called after
    each task run, done or failed. None of them: no presence subscription, nothing after a run."""

    def __init__(
        self,
        *tasks,
        limit: int | None = 10,
        presence_keys: Callable[[Iterable[str]], list[str]] | None = None,
        presence_id: str | None = None,
        after_run: Callable[[], None] | None = None,
    ):
        super().__init__(*tasks, limit=limit)
        self._presence_keys, self._presence_id, self._after_run = presence_keys, presence_id, after_run

    async def _subscribe_to_task_scheduling(self) -> None:
        base_url = get_current_settings().api.url
        if base_url is None:
            raise ValueError("PREFECT_API_URL must be set for a task worker (the ephemeral API has none)")
        if self._presence_keys is not None:
            self._runs_task_group.start_soon(self._stay_present, base_url)
        backoff = _Backoff("task runs", base_url)
        while True:
            while self.available_tasks == 0:
                await asyncio.sleep(_SLOT_POLL_S)
            try:
                task_run = await self._one_run(base_url)
            except _SUBSCRIBE_ERRORS as e:  # see the module docstring
                await backoff.after(e)
                continue
            backoff.failures = 0
            if await self._given_up(task_run):
                continue
            if await self._acquire_token(task_run.id):
                self._runs_task_group.start_soon(self._safe_submit_scheduled_task_run, task_run)

    async def _safe_submit_scheduled_task_run(self, task_run: TaskRun) -> None:
        await super()._safe_submit_scheduled_task_run(task_run)
        if self._after_run is not None:
            self._after_run()

    async def _stay_present(self, base_url: str) -> None:
        """Hold a subscription on the presence keys of the tasks served here for as long as this process runs."""
        backoff = _Backoff("presence", base_url)
        while True:
            presence = Subscription(
                model=TaskRun,
                path="/task_runs/subscriptions/scheduled",
                keys=self._presence_keys(sorted(self.task_keys)),
                client_id=self._presence_id,
                base_url=base_url,
            )
            try:
                await presence.__anext__()  # connects, then waits: no run is ever scheduled under these keys
            except _SUBSCRIBE_ERRORS as e:
                await backoff.after(e)

    async def _given_up(self, task_run: TaskRun) -> bool:
        """Whether `task_run` ended (its flow cancelled it) while it waited in the server's queue: it is dropped.

        Anything else runs, as Prefect's own worker would run it, "not found" included: the server hands a new
        submission to a worker before the transaction that created it commits (seen: a run read back at once was
        missing, and dropping it left its flow waiting for good)."""
        try:
            state = (await self._client.read_task_run(task_run.id)).state
        except (ObjectNotFound, httpx.HTTPError):
            return False
        if state is None or not state.is_final():
            return False
        task_worker_logger.info(
            "Not running task run %r (%s): it is %s while it waited for a worker (%s)",
            task_run.name,
            task_run.id,
            state.name,
            state.message or "no message",
        )
        return True

    async def _one_run(self, base_url: str) -> TaskRun:
        """Subscribe, receive one scheduled task run, acknowledge it and close the subscription."""
        subscription = Subscription(
            model=TaskRun,
            path="/task_runs/subscriptions/scheduled",
            keys=self.task_keys,
            client_id=self.client_id,
            base_url=base_url,
        )
        try:
            return await subscription.__anext__()  # connects, receives one run, acknowledges it
        finally:
            try:
                await subscription.websocket.close()  # before the server hands this worker another run
            except RuntimeError:
                pass  # never connected (shut down or failed while connecting)


class _Backoff:
    """Waits after failed subscriptions in a row (_RESUBSCRIBE_S, the last one repeating), each logged."""

    def __init__(self, what: str, base_url: str):
        self.what, self.base_url, self.failures = what, base_url, 0

    async def after(self, error: BaseException) -> None:
        wait = _RESUBSCRIBE_S[min(self.failures, len(_RESUBSCRIBE_S) - 1)]
        self.failures += 1
        task_worker_logger.warning(
            "subscribing to %s at %s failed (%s: %s, %d in a row); trying again in %.1f s",
            self.what,
            self.base_url,
            type(error).__name__,
            error or "no detail",
            self.failures,
            wait,
        )
        await asyncio.sleep(wait)
