"""How ppo_iteration runs one stage: as a task in-process, on a warm task worker, or on the run's update group.

In-process (the default): the stage task runs inside the iteration's flow run, with retries, the stage
cache key and results persisted under the run's storage.

On a warm worker (`pipeline.stage_workers: [rollout, score, update, checkpoint]`): the same task is submitted
with `.delay()` and runs in a long-lived `ppoflow worker` process that keeps its engine between iterations
(runtime/workers.py); the task run still belongs to the iteration's flow run, with the same cache key.

With `pipeline.rollout_parts: N` > 1 the rollout runs as N part task runs (in-process one after another, or side by
side on the warm rollout workers) and one merge task here that records the iteration's rollout manifest.

On the run's own update group (`train.num_ranks: N` > 1, update on no worker or pool): the training flow has started a
torchrun group of N ranks as a warm update worker on this machine (runtime/update_group.py); the update and checkpoint
tasks go to it as to any warm worker, each retried (pipeline.retries) once the group serves again.

On a pool (`pipeline.stage_pools`): runtime/pool_deployments.py.

`placement` (runtime/placement.py) is the one place that makes this choice (and the replay of a fork's rollout);
runtime/executors.py turns it into one Executor per stage, and `run_stage` there dispatches on it. The reward-model
stages (tasks/rm_train.py) run through the same `run_stage`, always in-process.
"""

from __future__ import annotations

import time
from typing import Callable, NoReturn, Optional

from prefect.client.schemas.objects import State
from prefect.futures import PrefectFuture
from prefect.states import Cancelled, Crashed

from ppoflow.config import PPOFlowConfig
from runtime.in_flight import earlier_failure
from runtime.placement import WORKER_STAGE, placement
from runtime.update_group import running
from stages.manifests import (
    HandOff,
    PolicyRef,
    RolloutManifest,
    StageManifest,
)
from storage.layout import layout_for
from storage.stage_records import write_stage_record
from tasks.leases import STALE_S, clear_lease, lease_holder_dead, read_lease, serving_workers
from tasks.results import result_storage_for
from tasks.retries import retry_delays, retry_options
from tasks.rm_train import RM_STAGE_TASKS
from tasks.stage_tasks import STAGE_TASKS, part_stage_name

# Every task run_stage_in_process can run: the PPO stages (which pools and warm workers serve too) and the
# reward-model stages (in-process only, see placement).
_TASKS = {**STAGE_TASKS, **RM_STAGE_TASKS}
# How long a wait for a warm worker waits on the task run's end (Prefect's event wakes it at once) before it looks
# again at what ends it early (_WorkerWatch: the worker's lease, the run's earlier iterations, the workers present).
# A dead worker or a failed earlier iteration ends the wait within this, which was 5 s (a killed worker's run ended
# up to ~10 s late: the death seen, then the next in-flight iteration's stop). Each look reads the task run from the
# Prefect server (twice) and the lease from the run's storage: a few small reads a second per waiting stage.
WATCH_S = 1.0


class StageFailed(RuntimeError):
    """A stage flow run on a work pool did not complete; names the stage, iteration and flow run.

    `stage_error`: the stage's own error as its flow run's state gives it ("RewardError: ..."; None when the run
    ended without one), and `where`: that flow run and its deployment. StageError (flows/failure.py) puts the
    error first in the training run's state message, then where it happened."""

    def __init__(self, message: str, stage_error: Optional[str] = None, where: Optional[str] = None):
        super().__init__(message)
        self.stage_error, self.where = stage_error, where

    def __reduce__(self):  # pickled with its stage error (Prefect may pickle a failed state's exception)
        return (type(self), (str(self), self.stage_error, self.where))


def run_stage_in_process(cfg: PPOFlowConfig, stage: str, iteration: int, record: str = "", **inputs) -> HandOff:
    """Run the stage task here; its manifest is recorded as `<run>/iter-<iteration>/_stages/<record or stage>.json`."""
    configured = _TASKS[stage].with_options(**retry_options(cfg), result_storage=result_storage_for(cfg))
    manifest = configured(cfg, iteration, **inputs)
    write_stage_record(layout_for(cfg), iteration, record or stage, manifest.model_dump(mode="json"))
    return manifest


def submit_to_worker(cfg: PPOFlowConfig, stage: str, iteration: int, name: str, **inputs) -> PrefectFuture:
    """Submit STAGE_TASKS[stage] with `.delay()` to the warm workers serving it, after clearing the lease `name` (the
    stage, or a rollout part's name) that a previous attempt's worker left; returns its future, for wait_for_worker.

    The submitting side's serializer only stores the submission (parameters and Prefect's run context, which JSON
    cannot hold) in Prefect's task scheduling storage; the worker persists the result as JSON. StageFailed, with
    nothing submitted, when an earlier in-flight iteration of the run has failed."""
    if why := earlier_failure(cfg, iteration):
        raise StageFailed(f"stage {_worker_stage_name(stage, name)} of iteration {iteration} was not run: {why}")
    clear_lease(layout_for(cfg), iteration, name)
    submit = STAGE_TASKS[stage].with_options(result_serializer="pickle")
    return submit.delay(cfg.model_dump(mode="json"), iteration, **inputs)


def wait_for_worker(cfg: PPOFlowConfig, future: PrefectFuture, stage: str, iteration: int, name: str) -> StageManifest:
    """The manifest of a task run submitted by submit_to_worker, recorded as `_stages/<name>.json`; raises its error,
    or StageFailed as _WorkerWatch says."""
    watch = _WorkerWatch(cfg, future, stage, iteration, name)
    # The future's own wait follows task-run events and can return before the final state is readable (seen:
    # "has no state"); the API's view of the run is what decides.
    while not (state := future.state).is_final():
        watch.check(state)
        try:
            future.wait(timeout=WATCH_S)
        except RuntimeError:  # Prefect: the task run "has no state": no worker has taken the submission yet
            time.sleep(0.5)  # (several iterations in flight, or more parts than free workers, queue for a worker)
    manifest = state.result(raise_on_failure=True)
    write_stage_record(watch.layout, iteration, name, manifest.model_dump(mode="json"))
    return manifest


class _WorkerWatch:
    """What ends a wait for a warm worker before its task run ends, each with StageFailed naming the stage:

    - the worker holding the stage's lease died (SIGKILL, OOM, a lost machine): the task run is set Crashed;
    - nobody has taken the submission yet (no lease, the run Scheduled or Pending) and an earlier in-flight
      iteration of the run has failed: this iteration cannot complete, and the worker it waits for may be the dead
      one (runtime/in_flight.py). The task run is set Cancelled, so that a worker started later drops it instead of
      running it (runtime/workers.py);
    - no lease, and no worker serving the stage has been present at the server for pipeline.deadlines.pickup_s
      (tasks/leases.py; the default is long enough for a worker started with the flow to import and connect):
      none will take the submission (Cancelled), or the one that took a stage without a lease (eval) is gone
      (Crashed).

    A submission queued behind a busy worker, or behind other submissions, waits as long as they take."""

    def __init__(self, cfg: PPOFlowConfig, future: PrefectFuture, stage: str, iteration: int, name: str):
        self.cfg, self.future, self.iteration, self.name = cfg, future, iteration, name
        self.layout = layout_for(cfg)
        self.stage = WORKER_STAGE.get(stage, stage)  # whose workers run it
        self.what = f"stage {_worker_stage_name(stage, name)} of iteration {iteration}"
        self.restart = _restart_advice(cfg, stage, iteration)
        self.task_key = STAGE_TASKS[stage].task_key
        self.unserved_since: Optional[float] = None
        self.released_since: Optional[float] = None  # since when the run is Running with no lease

    def check(self, state: State) -> None:
        lease = read_lease(self.layout, self.iteration, self.name)
        if why := lease_holder_dead(lease):
            self._end(Crashed, f"{self.what} was running on a warm worker that died: {why}. {self.restart}")
        if lease is not None:
            self.unserved_since, self.released_since = None, None
            return  # its worker lives and runs it
        taken = not (state.is_scheduled() or state.is_pending())
        if taken:
            # Running in Prefect's view, and no lease: a worker's body holds one from its first moment to its last
            # (tasks/leases.py), so past STALE_S the body has ended and its process ended before its final state reached
            # the server (seen when torchrun stops a rank right after its stage failed). Another worker serving the
            # stage is no sign of this run's progress.
            now = time.monotonic()
            self.released_since = self.released_since or now
            if now - self.released_since > STALE_S:
                self._end(
                    Crashed,
                    f"{self.what} ran on a warm worker that released it without its final state reaching the Prefect "
                    f"server within {STALE_S:.0f} s (the worker process ended right after the stage). {self.restart}",
                )
        if not taken and (why := earlier_failure(self.cfg, self.iteration)):
            self._end(Cancelled, f"{self.what} was not run: {why}")
        unserved_s = self._unserved_for()
        if unserved_s is None or unserved_s < self.cfg.pipeline.deadlines.pickup_s:
            return
        nobody = f"no worker serving it has been connected to the Prefect server for {unserved_s:.0f} s"
        if taken:
            self._end(Crashed, f"{self.what} was running on a warm worker that is gone: {nobody}. {self.restart}")
        self._end(Cancelled, f"{self.what} was not taken by any worker: {nobody}. {self.restart}")

    def _unserved_for(self) -> Optional[float]:
        """Seconds since the server first listed no worker serving the stage's task, busy or idle; None while it
        lists one or cannot say."""
        if serving_workers(self.task_key) != []:
            self.unserved_since = None
            return None
        now = time.monotonic()
        self.unserved_since = now if self.unserved_since is None else self.unserved_since
        return now - self.unserved_since

    def _end(self, final: Callable[..., State], message: str) -> NoReturn:
        """Set the task run's state (Crashed: its process died; Cancelled: it is not to run) and raise."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.set_task_run_state(self.future.task_run_id, final(message=message), force=True)
        raise StageFailed(message)


def _restart_advice(cfg: PPOFlowConfig, stage: str, iteration: int) -> str:
    """What a user does when a stage's worker is gone: on the update group this flow started, nothing but a retry
    (the flow starts a new group; starting `ppoflow worker` by hand would serve nothing this run submits); else
    start the workers' command where none runs."""
    if placement(cfg, stage, iteration) == "group":
        group = running()
        log = f"; its output is in {group.log_path}" if group is not None else ""
        return (
            f"The update group this run started (torchrun, train.num_ranks={cfg.train.num_ranks}) restarts its "
            f"ranks itself, up to --max-restarts={cfg.pipeline.retries + 1} times, and this flow resubmits the stage "
            f"up to pipeline.retries={cfg.pipeline.retries} times{log}. When those are spent, retry the flow run: it "
            f"starts a new group and the stage reruns from the last committed checkpoint"
        )
    return (
        f"Start `ppoflow worker --stage {WORKER_STAGE.get(stage, stage)}` (with this flow's code) where none runs "
        f"(a torchrun group or another supervisor restarts its own) and retry the flow run: the stage reruns from "
        f"the last committed checkpoint"
    )


def _worker_stage_name(stage: str, name: str) -> str:
    """How a failure names a stage run on workers: the workers' stage, and a rollout part's name after it."""
    worker_stage = WORKER_STAGE.get(stage, stage)
    return worker_stage if name == worker_stage else f"{worker_stage} ({name})"


def _parts(cfg: PPOFlowConfig, policy: PolicyRef) -> tuple[list[str], list[dict]]:
    """pipeline.rollout_parts = N > 1: each part's name (its stage record and lease) and task inputs."""
    parts = cfg.pipeline.rollout_parts
    names = [part_stage_name(part, parts) for part in range(parts)]
    return names, [{"policy": policy, "part": part, "parts": parts} for part in range(parts)]


def run_parts_in_process(cfg: PPOFlowConfig, iteration: int, policy: PolicyRef) -> RolloutManifest:
    """The rollout as N rollout-part task runs here, one after another (they share this process's one rollout engine,
    so threads would only queue on its stage lock), then the rollout-merge task (no engine) that records the
    iteration's one RolloutManifest (stages/rollout_parts.py)."""
    names, inputs = _parts(cfg, policy)
    manifests = [run_stage_in_process(cfg, "rollout-part", iteration, n, **i) for n, i in zip(names, inputs)]
    return run_stage_in_process(cfg, "rollout-merge", iteration, "rollout", parts=manifests)


def run_parts_on_workers(cfg: PPOFlowConfig, iteration: int, policy: PolicyRef) -> RolloutManifest:
    """The rollout as N rollout-part task runs on the warm workers serving rollout, every part submitted before any
    is awaited (each worker takes one task run at a time: they sample side by side), then the merge here."""
    names, inputs = _parts(cfg, policy)
    futures = [submit_to_worker(cfg, "rollout-part", iteration, n, **i) for n, i in zip(names, inputs)]
    manifests = [wait_for_worker(cfg, f, "rollout-part", iteration, n) for f, n in zip(futures, names)]
    return run_stage_in_process(cfg, "rollout-merge", iteration, "rollout", parts=manifests)


def run_stage_on_group(cfg: PPOFlowConfig, stage: str, iteration: int, **inputs: HandOff) -> StageManifest:
    """Run `stage` on the update group this process started (placement "group"), once it serves; a failed attempt is
    retried up to pipeline.retries times, after retry_delay_s doubling, each once the group serves again.

    Why here and not as the task's retries on the worker: a rank that died breaks the group, whose rank 0 then
    refuses every command until torchrun has restarted it (a new rank 0, a new worker process); only a new
    submission reaches the restarted group. Raises the last attempt's error; UpdateGroupFailed when the group has
    exited or does not serve (runtime/update_group.py); RuntimeError when this process runs no such group."""
    group = running()
    if group is None:
        raise RuntimeError(
            f"stage {stage} of iteration {iteration} goes to the update group the training flow starts "
            f"(train.num_ranks={cfg.train.num_ranks}), and none runs in this process"
        )
    delays = retry_delays(cfg)  # the one rule's count and waits (tasks/retries.py)
    attempt = 0
    while True:
        group.wait_ready()
        try:
            future = submit_to_worker(cfg, stage, iteration, stage, **inputs)
            return wait_for_worker(cfg, future, stage, iteration, stage)
        except Exception as exc:  # noqa: BLE001 - any stage failure is retried, as Prefect retries an in-process task
            if attempt == len(delays):
                raise
            delay_s = delays[attempt]
            attempt += 1
            _logger().warning(
                "stage %s of iteration %d failed on the update group (%s: %s); retry %d of %d in %.0f s, once the "
                "group serves again",
                stage,
                iteration,
                type(exc).__name__,
                str(exc)[:500],
                attempt,
                cfg.pipeline.retries,
                delay_s,
            )
            time.sleep(delay_s)


def _logger():
    """The Prefect run logger of the flow or task run this thread is in (its lines reach the UI), else a plain one."""
    import logging

    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)
