"""A SIGTERM whose exception Python drops is delivered again, where the run would go on with new work.

Prefect 3.7.7: while a flow runs, `capture_sigterm` (prefect.utilities.engine) installs `_prefect_sigterm_handler`,
which raises TerminationSignal in the main thread, wherever the main thread is. Python runs a signal handler between
two bytecodes of whatever the main thread executes at that moment; when that is a weakref callback or a finalizer
(the garbage collector runs them anywhere, e.g. a WeakValueDictionary's `remove`), Python prints "Exception ignored
in ..." and drops the exception: the run trains on as if no signal had come. Seen in 1 of 8 SIGTERMs of
`ppoflow demo`. ppoflow's own handler (flows/failure.raise_on_sigterm) raises the same way and can be dropped the
same way.

`remember_sigterm` wraps Prefect's handler, and `noting_sigterm` ppoflow's, so that each notes the signal before it
raises. Prefect installs its handler and compares the installed one with it by the module global's name, at call
time, so the wrapper is what it installs and finds. `redeliver_lost_sigterm`, called in the main thread where a
run goes on to new work (before each stage of an iteration, between pipelined iterations), sends the noted signal
to the process again: the handler in place then raises in that ordinary code. A signal that was not dropped
unwinds the main thread past those points, so they only ever see a dropped one.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Any, Callable

_noted = threading.Event()
_MARK = "_ppoflow_notes_sigterm"


def noting_sigterm(handler: Callable[..., Any]) -> Callable[..., Any]:
    """`handler` (a SIGTERM handler) that first notes the signal for `redeliver_lost_sigterm`."""

    @functools.wraps(handler)
    def noted(signum: int, *args: Any) -> Any:
        _noted.set()
        return handler(signum, *args)

    setattr(noted, _MARK, True)
    return noted


def remember_sigterm() -> bool:
    """Make Prefect's SIGTERM handler note the signal before it raises (idempotent); False when Prefect has no
    such handler (then nothing is changed).

    Works around: Prefect 3.7.7's TerminationSignal is dropped when its handler runs inside a weakref callback or
    finalizer (module docstring). Installed by adaptations.install_process_adaptations; still needed while
    tests/unit/test_adaptations_prefect_sigterm.py finds upstream's signal dropped. Installed inside a flow run
    (a deployment's run enters ppo_training and installs the adaptations there), it also replaces the handler
    Prefect put in place for that run, so that Prefect's identity checks (a nested flow's bridge, a cancellation's
    acknowledgement) keep finding its bridge."""
    try:
        from prefect.utilities import engine
    except ImportError:
        return False
    handler = getattr(engine, "_prefect_sigterm_handler", None)
    if not callable(handler):
        return False
    if getattr(handler, _MARK, False):
        return True
    noted = noting_sigterm(handler)
    with getattr(engine, "_prefect_sigterm_bridge_lock", threading.RLock()):
        engine._prefect_sigterm_handler = noted
        # Installed from inside a flow run (a deployment's run calls install_process_adaptations in its flow): the
        # handler in place is the one Prefect installed, which it now compares with `noted` (a nested flow's
        # bridge, a cancellation's acknowledgement): put `noted` in its place.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, noted)
    return True


def redeliver_lost_sigterm() -> None:
    """In the main thread: if a SIGTERM was noted, send it again (its handler raises here, from `os.kill`).
    Elsewhere: nothing (only the main thread runs signal handlers, and a thread that goes on is no sign that the
    main thread dropped one)."""
    if threading.current_thread() is threading.main_thread() and _noted.is_set():
        _noted.clear()
        os.kill(os.getpid(), signal.SIGTERM)
