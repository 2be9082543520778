"""The iterations in flight in this process (flows/pipeline.py), and how an iteration waits for the one before.

Its own module because both sides use it: the training flow registers each in-flight iteration's future,
and the iteration subflow (flows/iteration.py), running in a slot's thread, waits on its predecessor's.
"""

from __future__ import annotations

import threading
from typing import Optional

from prefect.futures import PrefectFuture

from storage.layout import layout_for


class PreviousIterationFailed(RuntimeError):
    """Iteration i cannot update: iteration i-1, whose committed policy it trains, did not complete."""


# (run directory, iteration) -> the future of that iteration's slot, for the iterations in flight in this
# process; `wait_for_previous` reads it from the iteration subflows, which run in the slots' threads.
_in_flight: dict[tuple[str, int], PrefectFuture] = {}
_lock = threading.Lock()


def wait_for_previous(cfg, iteration: int) -> None:
    """Block until iteration-1 of this run, when it is in flight in this process, has ended; raise
    PreviousIterationFailed when it ended other than Completed. Iterations not in flight here (committed
    before this start, or a run without pipelining) are left to the caller's commit check."""
    with _lock:
        previous = _in_flight.get((layout_for(cfg).run_dir, iteration - 1))
    if previous is None:
        return
    previous.wait()
    state = previous.state
    if not state.is_completed():
        raise PreviousIterationFailed(
            f"iteration {iteration} cannot update: iteration {iteration - 1}, whose committed policy it trains, "
            f"ended {state.name} ({state.message or 'no message'}); its rollout and score are kept (cached) for "
            f"the retry"
        )


def register_in_flight(run_dir: str, iteration: int, future: Optional[PrefectFuture]) -> None:
    """Record (future) or forget (None) the slot of `iteration` of the run stored at `run_dir`."""
    with _lock:
        if future is None:
            _in_flight.pop((run_dir, iteration), None)
        else:
            _in_flight[(run_dir, iteration)] = future
