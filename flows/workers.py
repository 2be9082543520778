"""Warm stage workers: long-lived processes that run stage tasks and keep their engines between iterations.

    ppoflow worker --stage rollout                      a rollout worker (vLLM or HF sampler stays up)
    ppoflow worker --stage update --stage checkpoint    the trainer's worker (DeepSpeed engine stays up)

Mechanism: Prefect's task workers (`prefect.task_worker.serve`). The training flow submits a stage task
with `.delay(...)` (pipeline.stage_workers names which stages); the server hands each task run to ONE worker
serving that task, which runs it in its own process, in a thread, with the task's cache key and retries. So
the engines registries (engines/warm.py, engines/rollout/registry.py) stay warm across iterations and runs,
and a worker whose engine holds other weights loads the committed policy named in the stage's input in
place. Why not a served flow (`flow.serve`) or a process work pool: both start a new process per flow run,
which is the cold start this removes. Several workers may serve one stage (the server gives each task run
to one of them).

What the worker decides, not the submitting flow: a task's retries (`--retries`) and where its results
persist (Prefect's default result storage; on several machines point PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK
and PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK at a shared block, e.g. S3).
"""

from __future__ import annotations

from typing import Sequence

STAGES = ("rollout", "score", "update", "checkpoint")


def serve_stages(stages: Sequence[str], retries: int = 0, limit: int = 1) -> None:
    """Serve the stage tasks of `stages` in this process until interrupted. limit: task runs at once (1:
    one trainer or sampler must not run two stages at the same time)."""
    from prefect.task_worker import serve

    from tasks.leases import serve_as_worker
    from tasks.stages import STAGE_TASKS

    unknown = sorted(set(stages) - set(STAGES))
    if unknown or not stages:
        raise ValueError(f"ppoflow worker --stage {unknown or '(none)'}: allowed are {', '.join(STAGES)}")
    served = list(dict.fromkeys(stages)) + (["eval"] if "rollout" in stages else [])  # eval uses rollout's engine
    tasks = [STAGE_TASKS[s].with_options(retries=retries) for s in served]
    serve_as_worker()  # stage bodies hold leases: the submitting flow finds out if this process dies
    serve(*tasks, limit=limit)
