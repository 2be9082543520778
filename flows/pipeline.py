"""Pipelined iterations (`pipeline.max_staleness` = k >= 1): up to k+1 iterations in flight.

    iteration i-1:  rollout  score  update  checkpoint
    iteration i:            rollout  score  .......... update  checkpoint          (k = 1)

The schedule is fixed. Iteration i may start once iteration i-1-k has ended, because its rollout samples
the policy that iteration committed (stages/policy.behaviour_policy_ref); its rollout and score
then run while the iterations before it update. Its update trains the policy committed at i-1 (the trainer
moves through the iterations one after another), so it waits for iteration i-1 to commit (`wait_for_previous`).
Every input of every stage is thus a function of the iteration alone: the stage cache keys stay exact, a
retried or resumed run samples and trains exactly what an uninterrupted one did, and the rows sampled by an
older policy carry the off-policy correction of engines/ppo/off_policy.py.

How they run: each iteration is still its own subflow run (`<run>/iter-NNNN`, flows/iteration.py) with its stage
task runs; the training flow submits each as a task run `iteration-NNNN` to Prefect's thread-pool task runner
(Prefect's concurrent submission, so the UI shows which stage of which iteration is running). Stages on
warm workers or pools run in their processes; in-process stages share one process (engines/warm.py: one
rollout and one score at a time, the trainer borrowed while its weights are copied).

Failure: an iteration that fails fails the ones after it at their update (their rollout and score finish and
are cached), but a stage of theirs on a warm worker that no worker has started yet is not run: the worker it
waits for may be the one that died (runtime/in_flight.earlier_failure). The training flow waits for the in-flight
iterations to end and raises the first error. A Retry of the flow run, or the next start of the
run, resumes from the last commit: each in-flight iteration at its first uncached stage.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import SettingsContext, get_settings_context
from prefect.futures import PrefectFuture

from adaptations.prefect_sigterm import redeliver_lost_sigterm
from flows.iteration import ppo_iteration
from runtime.in_flight import register_in_flight
from storage.layout import layout_for


def subflow_settings() -> SettingsContext:
    """A settings context for an iteration subflow: Prefect's settings with no heartbeat of its own."""
    # One heartbeat thread per process is enough: the training flow run's (Prefect marks it Crashed when the
    # process dies). A subflow's own heartbeat thread sleeps in 1 s steps and is joined when the subflow ends,
    # which costs ~0.25 s per iteration on average for nothing. The settings copy (~50 ms) is made once.
    outer = get_settings_context()
    if _quiet.get("outer") is not outer.settings:  # a strong reference: identity, not a reusable id()
        _quiet.update(
            outer=outer.settings, settings=outer.settings.copy_with_update(updates={"flows.heartbeat_frequency": None})
        )
    return SettingsContext(profile=outer.profile, settings=_quiet["settings"])


_quiet: dict[str, Any] = {}


@task(name="ppo-iteration-slot", task_run_name="iteration-{iteration:04d}", cache_policy=NO_CACHE, retries=0)
def iteration_slot(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    """One in-flight iteration: its subflow run, in a thread of the training flow's task runner."""
    with subflow_settings():
        return ppo_iteration(config, iteration)


def run_pipelined(cfg, start: int, on_row: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Iterations start..run.iterations with up to k+1 in flight; `on_row` sees each metrics row in order.

    Iteration i+k+1 is submitted when iteration i ends: iterations end in order (each update waits for the
    one before), so k+1 in flight is exactly "i may start once i-1-k has ended"."""
    k = cfg.pipeline.max_staleness
    run_dir = layout_for(cfg).run_dir
    config = cfg.model_dump(mode="json")
    in_flight: deque[tuple[int, PrefectFuture]] = deque()
    rows: list[dict[str, Any]] = []
    upcoming = start
    try:
        while upcoming <= cfg.run.iterations or in_flight:
            redeliver_lost_sigterm()  # the iterations run in threads: the main thread checks for a dropped SIGTERM
            while upcoming <= cfg.run.iterations and len(in_flight) <= k:
                future = iteration_slot.submit(config, upcoming)
                register_in_flight(run_dir, upcoming, future)
                in_flight.append((upcoming, future))
                upcoming += 1
            _, future = in_flight.popleft()
            row = future.result()  # raises the iteration's error
            rows.append(row)
            on_row(row)
    except BaseException:
        for _, future in in_flight:  # they fail at their update, or finish: let their runs end before raising
            future.wait()
        raise
    finally:
        for iteration in range(start, upcoming):
            register_in_flight(run_dir, iteration, None)
    return rows
