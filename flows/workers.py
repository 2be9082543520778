"""Warm stage workers: long-lived processes that run stage tasks and keep their engines between iterations.

    ppoflow worker --stage rollout                      a rollout worker (vLLM or HF sampler stays up)
    ppoflow worker --stage update --stage checkpoint    the trainer's worker (DeepSpeed engine stays up)

Mechanism: Prefect's task workers (`prefect.task_worker.serve`). The training flow submits a stage task
with `.delay(...)` (pipeline.stage_workers names which stages); the server hands each task run to ONE worker
serving that task, which runs it in its own process, in a thread, with the task's cache key and retries (the stage
body itself on the process's one compute thread: engines/compute_thread.py says why). So
the engines registries (engines/warm.py, engines/rollout/registry.py) stay warm across iterations and runs,
and a worker whose engine holds other weights loads the committed policy named in the stage's input in
place. Why not a served flow (`flow.serve`) or a process work pool: both start a new process per flow run,
which is the cold start this removes. Several workers may serve one stage (the server gives each task run
to one of them): with `pipeline.rollout_parts: N`, the N parts of an iteration's rollout are N task runs, so N
rollout workers sample them side by side (data parallelism).

One change to Prefect's task worker (`SlotTaskWorker`): it holds a subscription to the server only while it has
a free slot, and takes one task run per subscription. Prefect's own worker stays subscribed while busy, and the
server hands it the next run at once (it waits in the worker until the slot frees), so of two idle-looking
workers a busy one could take the second part of a split rollout while the other sat idle. Closing the
subscription with the run received makes the server put a run it was handing over back into its queue, for
a worker with a free slot. It overrides Prefect's private subscription loop (prefect 3.7.7, pinned).
Two more things it does there: it holds a second subscription, on presence keys, for as long as it runs, so that
the submitting flow can tell a busy worker from none (tasks/leases.py); and it drops, unrun, a task run that was
cancelled while it waited in the server's queue (flows/stage_runs.py cancels a submission that no worker had taken
when it gives up waiting: a worker started later must not run a stage its flow no longer waits for).

Several update ranks (engines/trainer/torchrun_group.py): `torchrun --nproc-per-node=N --no-python ppoflow worker
--stage update --stage checkpoint` (and --nnodes, --rdzv-backend=c10d, --rdzv-endpoint for several nodes) starts N
such processes; rank 0 serves the stages here as one worker, the others follow its commands and never talk to
Prefect. After a stage that broke the group rank 0 ends its process, so that torchrun restarts the whole group.
A run with train.num_ranks > 1 and no worker or pool for its update gets such a group from its training flow
(flows/update_group.py); a worker that torchrun did not start refuses such a run's update (stages/update_ranks.py).

What the worker decides, not the submitting flow: a task's retries (`--retries`) and where its results
persist (Prefect's default result storage; on several machines point PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK
and PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK at a shared block, e.g. S3).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Sequence

import httpx
from prefect._internal.concurrency.api import create_call, from_sync
from prefect.client.schemas.objects import TaskRun
from prefect.client.subscriptions import Subscription
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings
from prefect.task_worker import StopTaskWorker, TaskWorker
from prefect.task_worker import logger as task_worker_logger
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from tasks.leases import presence_id, presence_key

STAGES = ("rollout", "score", "update", "checkpoint")
_SLOT_POLL_S = 0.05  # how soon a worker whose slot freed subscribes again
# OSError includes TimeoutError (the handshake's); a refused or dropped handshake, a close while waiting
_SUBSCRIBE_ERRORS = (OSError, InvalidHandshake, ConnectionClosed)
_RESUBSCRIBE_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # waits after failed subscriptions in a row (the last one repeats)


class SlotTaskWorker(TaskWorker):
    """Prefect's TaskWorker that takes a task run only while it has a free slot (see the module docstring)."""

    async def _subscribe_to_task_scheduling(self) -> None:
        base_url = get_current_settings().api.url
        if base_url is None:
            raise ValueError("PREFECT_API_URL must be set for a task worker (the ephemeral API has none)")
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
        _end_if_group_broke()

    async def _stay_present(self, base_url: str) -> None:
        """Hold a subscription on the presence keys of the tasks served here for as long as this process runs."""
        backoff = _Backoff("presence", base_url)
        while True:
            presence = Subscription(
                model=TaskRun,
                path="/task_runs/subscriptions/scheduled",
                keys=[presence_key(key) for key in sorted(self.task_keys)],
                client_id=presence_id(),  # not the work subscription's: the server forgets a client id at its close
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


def serve_stages(stages: Sequence[str], retries: int = 0, limit: int = 1) -> None:
    """Serve the stage tasks of `stages` in this process until interrupted. limit: task runs at once (1:
    one trainer or sampler must not run two stages at the same time)."""
    from engines import compute_thread
    from tasks.leases import serve_as_worker
    from tasks.stage_tasks import STAGE_TASKS

    unknown = sorted(set(stages) - set(STAGES))
    if unknown or not stages:
        raise ValueError(f"ppoflow worker --stage {unknown or '(none)'}: allowed are {', '.join(STAGES)}")
    _join_torchrun_group(stages)  # under torchrun: ranks 1..N-1 follow rank 0 there and never return
    # eval and the parts of a split rollout (pipeline.rollout_parts) sample with the rollout engine
    served = list(dict.fromkeys(stages)) + (["rollout-part", "eval"] if "rollout" in stages else [])
    tasks = [STAGE_TASKS[s].with_options(retries=retries) for s in served]
    serve_as_worker()  # stage bodies hold leases: the submitting flow finds out if this process dies
    compute_thread.pin_to_one_thread()  # the task runs come on several threads; the bodies' torch on one
    # As prefect.task_worker.serve runs its worker: in Prefect's event loop thread (so SIGTERM ends the process as
    # it does a `prefect task serve`: TaskWorker installs its own handler only from the main thread).
    try:
        from_sync.call_soon_in_loop_thread(create_call(_serve, tasks, limit)).result()
    except KeyboardInterrupt:
        pass


async def _serve(tasks: list, limit: int) -> None:
    worker = SlotTaskWorker(*tasks, limit=limit)  # made inside the loop: TaskWorker needs a running one
    try:
        await worker.astart()
    except StopTaskWorker:
        pass


def _join_torchrun_group(stages: Sequence[str]) -> None:
    """When torchrun started this process: join its group (every rank at once); ranks 1..N-1 then follow rank 0's
    commands until it stops them and end their process there; rank 0 returns and serves. Nothing otherwise.

    ValueError when such a group is asked to serve a stage other than update and checkpoint."""
    from engines.trainer import torchrun_group
    from stages.update_ranks import follow

    if not torchrun_group.launched():
        return
    if "update" not in stages or set(stages) - {"update", "checkpoint"}:
        raise ValueError(
            f"ppoflow worker --stage {' --stage '.join(stages)} under torchrun: a torchrun group is the update "
            f"worker; serve --stage update (and --stage checkpoint) with it, the other stages with plain workers"
        )
    group = torchrun_group.join()
    if group.rank != 0:
        follow(group)


def _end_if_group_broke() -> None:
    """After a task run: when it broke the torchrun group this process is rank 0 of, end the process (its stage has
    failed with the error already), so that torchrun restarts every rank of the group from a clean state."""
    from engines.trainer import torchrun_group

    group = torchrun_group.current()
    if group is None or group.broken is None:
        return
    task_worker_logger.error("the update group broke (%s): rank 0 exits, torchrun restarts the group", group.broken)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
