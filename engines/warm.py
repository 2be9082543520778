"""Process-wide cache of long-lived engines (reference model, scorer, trainer).

Loading a model per iteration is too slow, so a worker process keeps its engines between stage runs.
An entry is keyed by (role, identity); `invalidate(role)` drops an entry whose in-memory state can no
longer be trusted (e.g. a trainer whose update failed half-way: the retry must rebuild it from the last
committed checkpoint, or resuming would not equal never crashing).

The rollout engines have their own registry (engines/rollout/registry.py) because they also refresh
weights in place.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_lock = threading.Lock()
_entries: dict[str, tuple[str, Any]] = {}


def get_or_build(role: str, identity: str, build: Callable[[], T]) -> T:
    """The engine for `role` if it was built for `identity`, else a new one from `build()` (the old is dropped)."""
    with _lock:
        entry = _entries.get(role)
        if entry is not None and entry[0] == identity:
            return entry[1]
        _entries.pop(role, None)
    engine = build()
    with _lock:
        _entries[role] = (identity, engine)
    return engine


def peek(role: str) -> tuple[str, Any] | None:
    """(identity, engine) held for `role`, or None."""
    with _lock:
        return _entries.get(role)


def retag(role: str, identity: str) -> None:
    """Record that the engine held for `role` now corresponds to `identity` (after it advanced its own state)."""
    with _lock:
        if role in _entries:
            _entries[role] = (identity, _entries[role][1])


def invalidate(role: str | None = None) -> None:
    """Forget one role's engine (or all); the next get_or_build rebuilds it."""
    with _lock:
        if role is None:
            _entries.clear()
        else:
            _entries.pop(role, None)
