"""The iterations in flight in this process (flows/pipeline.py), how an iteration waits for the one before, and
how the ones after a failed iteration learn of it.

Its own module because both sides use it: the training flow registers each in-flight iteration's future,
and the iteration subflow (flows/iteration.py), running in a slot's thread, waits on its predecessor's.
"""

from __future__ import annotations

import threading
from typing import Optional

from prefect.client.schemas.objects import State
from prefect.futures import PrefectFuture

from storage.layout import layout_for


class PreviousIterationFailed(RuntimeError):
    """Iteration i cannot update: iteration i-1, whose committed policy it trains, did not complete."""


class _Slot:
    """One in-flight iteration: its slot's future, and `ended`, set when the iteration committed its checkpoint
    or its slot ended (whichever comes first); `committed` says which."""

    def __init__(self, future: PrefectFuture):
        self.future = future
        self.committed = False
        self.ended = threading.Event()
        future.add_done_callback(lambda _: self.ended.set())


# (run directory, iteration) -> that iteration's slot, for the iterations in flight in this process;
# `wait_for_previous` reads it from the iteration subflows, which run in the slots' threads.
_in_flight: dict[tuple[str, int], _Slot] = {}
_lock = threading.Lock()


def wait_for_previous(cfg, iteration: int) -> None:
    """Block until iteration-1 of this run, when it is in flight in this process, has committed its checkpoint
    (or ended without one: then raise PreviousIterationFailed). Iterations not in flight here (committed before
    this start, or a run without pipelining) are left to the caller's commit check.

    Why the commit and not the end of iteration-1's slot: what follows its commit (metrics row, artifacts, a due
    eval, the subflow's final state) is not an input of this update, and waiting for it put ~0.1-0.2 s per
    iteration on the trainer's path. A failure after that commit (an eval) fails iteration-1's slot, which the
    training flow raises; this update trains a committed policy either way."""
    with _lock:
        previous = _in_flight.get((layout_for(cfg).run_dir, iteration - 1))
    if previous is None:
        return
    previous.ended.wait()
    state = _ended_uncommitted(previous)
    if state is not None and not state.is_completed():
        raise PreviousIterationFailed(
            f"iteration {iteration} cannot update: iteration {iteration - 1}, whose committed policy it trains, "
            f"ended {state.name} ({state.message or 'no message'}); its rollout and score are kept (cached) for "
            f"the retry"
        )


def earlier_failure(cfg, iteration: int) -> Optional[str]:
    """Why an earlier iteration of this run, in flight in this process, ended without committing ("iteration 3 ended
    Failed (...)"), else None. Then `iteration` can no longer complete (its update would raise
    PreviousIterationFailed), and a stage of it that has not started on a warm worker is not run
    (runtime/stage_runs.py): the worker it waits for may be the one that died, and waiting for it would keep the run
    from ending."""
    run_dir = layout_for(cfg).run_dir
    with _lock:
        iterations = sorted(i for d, i in _in_flight if d == run_dir and i < iteration)
        earlier = [(i, _in_flight[run_dir, i]) for i in iterations]
    for earlier_iteration, slot in earlier:
        state = _ended_uncommitted(slot)
        if state is not None and not state.is_completed():
            return f"iteration {earlier_iteration} ended {state.name} ({state.message or 'no message'})"
    return None


def _ended_uncommitted(slot: _Slot) -> Optional[State]:
    """The final state of a slot that ended without committing its checkpoint; None while it runs or once committed."""
    if not slot.ended.is_set() or slot.committed:
        return None
    slot.future.wait()  # ended: returns at once, and keeps the final state (no API read)
    return slot.future.state


def mark_committed(cfg, iteration: int) -> None:
    """Iteration `iteration` of this run committed its checkpoint: release the update of iteration+1 waiting
    in `wait_for_previous` (a no-op when the iteration is not in flight here)."""
    with _lock:
        slot = _in_flight.get((layout_for(cfg).run_dir, iteration))
    if slot is not None:
        slot.committed = True
        slot.ended.set()


def register_in_flight(run_dir: str, iteration: int, future: Optional[PrefectFuture]) -> None:
    """Record (future) or forget (None) the slot of `iteration` of the run stored at `run_dir`."""
    with _lock:
        if future is None:
            _in_flight.pop((run_dir, iteration), None)
        else:
            _in_flight[(run_dir, iteration)] = _Slot(future)
