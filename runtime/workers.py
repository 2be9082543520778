"""Warm stage workers: long-lived processes that run stage tasks and keep their engines between iterations.

    ppoflow worker --stage rollout                      a rollout worker (vLLM or HF sampler stays up)
    ppoflow worker --stage update --stage checkpoint    the trainer's worker (DeepSpeed engine stays up)

Mechanism: Prefect's task workers (`prefect.task_worker.serve`). The training flow submits a stage task
with `.delay(...)` (pipeline.stage_workers names which stages); the server hands each task run to ONE worker
serving that task, which runs it in its own process, with the task's cache key and retries, one task run at a time
and every one on the same thread (below). So the engines registries (engines/warm.py,
engines/rollout/registry.py) stay warm across iterations and runs, and a worker whose engine holds other weights
loads the committed policy named in the stage's input in place. Why not a served flow (`flow.serve`) or a process
work pool: both start a new process per flow run,
which is the cold start this removes. Several workers may serve one stage (the server gives each task run
to one of them): with `pipeline.rollout_parts: N`, the N parts of an iteration's rollout are N task runs, so N
rollout workers sample them side by side (data parallelism).

The worker is Prefect's task worker as adaptations/prefect_task_worker.py changes it (`SlotTaskWorker`): it takes a
task run only while it has a free slot, so a busy worker does not take the second part of a split rollout from an
idle one; it holds a presence subscription for as long as it runs (its keys and client id from tasks/leases.py), so
that the submitting flow can tell a busy worker from none; it drops, unrun, a task run cancelled while it waited
in the server's queue (runtime/stage_runs.py cancels a submission that no worker had taken when it gives up waiting:
a worker started later must not run a stage its flow no longer waits for).

Several update ranks (engines/trainer/torchrun_group.py): `torchrun --nproc-per-node=N --no-python ppoflow worker
--stage update --stage checkpoint` (and --nnodes, --rdzv-backend=c10d, --rdzv-endpoint for several nodes) starts N
such processes; rank 0 serves the stages here as one worker, the others follow its commands and never talk to
Prefect. After a stage that broke the group rank 0 ends its process, so that torchrun restarts the whole group.
A run with train.num_ranks > 1 and no worker or pool for its update gets such a group from its training flow
(runtime/update_group.py); a worker that torchrun did not start refuses such a run's update (stages/update_ranks.py).

One thread for every stage body: the task worker takes one task run at a time (limit 1: one trainer or sampler must
not run two stages at once), and Prefect runs each in a thread of a pool as large as that limit, so every task run of
the process comes on its one thread. It matters for speed: torch's CPU kernels run on OpenMP (libgomp), which keeps
a team of threads per thread that has run a parallel region; once the process's teams together hold more threads
than there are cores, libgomp sleeps at its barriers instead of spinning and every small op pays a futex wake-up.
Measured on the 2-core machine (OMP_NUM_THREADS=2, 300 forward/backward passes of a small MLP): 0.22 s on one thread,
1.07-1.15 s on a second thread once the first had run any op; bench.overhead's update 4.4-5.4 s on one thread against
8.9-10.4 s on a new one. tests/integration/test_stage_workers.py checks that each worker ran its bodies on one thread.

A stage that fails on a worker is retried there by the submitted run's pipeline.retries and retry_delay_s, as it would
be in the flow's process (tasks/retries.py: one rule). What the worker decides, not the submitting flow: where results
persist (Prefect's default result storage; on several machines point PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK
and PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK at a shared block, e.g. S3).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from prefect._internal.concurrency.api import create_call, from_sync
from prefect.task_worker import StopTaskWorker
from prefect.task_worker import logger as task_worker_logger

from adaptations.prefect_task_worker import SlotTaskWorker
from tasks.leases import presence_id, presence_key

STAGES = ("rollout", "score", "update", "checkpoint")


def serve_stages(stages: Sequence[str]) -> None:
    """Serve the stage tasks of `stages` in this process, one task run at a time and all on one thread (the module
    docstring says why), until interrupted."""
    from tasks.leases import serve_as_worker
    from tasks.retries import worker_options
    from tasks.stage_tasks import STAGE_TASKS

    unknown = sorted(set(stages) - set(STAGES))
    if unknown or not stages:
        raise ValueError(f"ppoflow worker --stage {unknown or '(none)'}: allowed are {', '.join(STAGES)}")
    _join_torchrun_group(stages)  # under torchrun: ranks 1..N-1 follow rank 0 there and never return
    # eval and the parts of a split rollout (pipeline.rollout_parts) sample with the rollout engine
    served = list(dict.fromkeys(stages)) + (["rollout-part", "eval"] if "rollout" in stages else [])
    tasks = [STAGE_TASKS[s].with_options(**worker_options()) for s in served]
    serve_as_worker()  # stage bodies hold leases: the submitting flow finds out if this process dies
    # As prefect.task_worker.serve runs its worker: in Prefect's event loop thread (so SIGTERM ends the process as
    # it does a `prefect task serve`: TaskWorker installs its own handler only from the main thread).
    try:
        from_sync.call_soon_in_loop_thread(create_call(_serve, tasks)).result()
    except KeyboardInterrupt:
        pass


async def _serve(tasks: list) -> None:
    # made inside the loop: TaskWorker needs a running one. limit=1: one task run at a time, so Prefect's pool of task
    # threads has one thread, which every stage body of this process runs on (the module docstring says why)
    worker = SlotTaskWorker(
        *tasks,
        limit=1,
        presence_keys=lambda keys: [presence_key(key) for key in keys],
        presence_id=presence_id(),
        after_run=_end_if_group_broke,
    )
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
