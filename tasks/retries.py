"""One retry rule for a stage task wherever it runs: up to pipeline.retries more attempts, the k-th after
pipeline.retry_delay_s * 2**(k-1) seconds, by Prefect's task retries (the task run shows AwaitingRetry / Retrying).

- In the flow's process and in a pool deployment's process the task is configured from the run's config before it
  is called: `retry_options(cfg)`.
- A warm worker serves its tasks before any run is known, and one worker serves runs with different configs, so it
  serves them with WORKER_RETRY_CAP retries and `retry_as_submitted` as Prefect's retry condition, which reads the
  submitted run's config from the task run's parameters: the same count and the same delays. The delay is waited
  there, in the worker, holding the stage's lease (tasks/leases.py), so that the flow watching the stage does not take
  a worker waiting to retry for one that ended the stage without a final state.
- A torchrun group's rank 0 never retries on its own: a failed update may have broken the group, whose processes
  torchrun then restarts, and the flow resubmits the stage instead (runtime/stage_runs.run_stage_on_group), up to
  the same pipeline.retries.

Failure mode: a retry condition that raises is logged by Prefect and counts as "do not retry".
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ppoflow.config import PPOFlowConfig, as_config
from ppoflow.config.pipeline import MAX_RETRIES
from storage.layout import layout_for
from tasks.leases import stage_lease
from tasks.stage_tasks import lease_name

WORKER_RETRY_CAP = MAX_RETRIES  # the most any config asks for; retry_as_submitted stops at the config's own count
_log = logging.getLogger("ppoflow.retries")


def retry_delays(cfg: PPOFlowConfig) -> list[float]:
    """The wait before each retry, in seconds: retry_delay_s doubling, one per retry."""
    return [cfg.pipeline.retry_delay_s * 2**k for k in range(cfg.pipeline.retries)]


def retry_options(cfg: PPOFlowConfig) -> dict[str, Any]:
    """Prefect task options for a stage task run with `cfg` known before the call (in-process, pool process)."""
    return {"retries": cfg.pipeline.retries, "retry_delay_seconds": retry_delays(cfg) or 0}


def worker_options() -> dict[str, Any]:
    """Prefect task options for a stage task a warm worker serves (module docstring)."""
    return {"retries": WORKER_RETRY_CAP, "retry_delay_seconds": 0, "retry_condition_fn": retry_as_submitted}


def retry_as_submitted(task, task_run, state) -> bool:
    """Prefect retry condition of a warm worker's stage task: retry while the submitted config's pipeline.retries
    allow, after its delay (waited here, the stage's lease held). task_run.run_count: the attempts so far, the
    failed one included."""
    from prefect.context import TaskRunContext

    from engines.trainer import torchrun_group

    if torchrun_group.launched():
        return False  # the flow resubmits to a group (module docstring)
    parameters = TaskRunContext.get().parameters
    cfg = as_config(parameters["config"])
    delays = retry_delays(cfg)
    if task_run.run_count > len(delays):
        return False
    delay = delays[task_run.run_count - 1]
    iteration = parameters["iteration"]
    _log.info(
        "%s of iteration %d failed (%s); retry %d of pipeline.retries=%d in %.1f s",
        task.name,
        iteration,
        state.message,
        task_run.run_count,
        len(delays),
        delay,
    )
    with stage_lease(layout_for(cfg), iteration, lease_name(task.name, parameters)):
        time.sleep(delay)
    return True
