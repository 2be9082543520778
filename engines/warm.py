"""Process-wide cache of long-lived engines: the tokenised prompts, the scorer, the score cache, the trainer.

Loading a model per iteration is too slow, so a worker process keeps its engines between stage runs. Each
role holds at most one engine, under a `WarmKey(role, identity)`: the identity says exactly what the engine
was built from (a config hash and file fingerprints, or for the trainer the identity of the weights it
holds), and an engine is handed out only for the identity it was built for.

    get_or_build(key, build)  the held engine if built for key.identity, else build() (the old one dropped)
    peek(key)                 the held engine if it is for key.identity, else None; keeps it
    take(key)                 like peek, but removes whatever the role holds: the caller now owns it
    borrowed(key)             with-block: peek, with take/put of that role held off until the block ends
    put(key, engine)          hand an engine (back) to the role, e.g. a trainer after it saved its new state
    invalidate(role=None)     forget a role's engine (or all)
    engine_builds()           how many engines this process has built (every role, rollout engines too)

take/put is how a trainer moves through an update: taken before the update, put back under its new
weights' identity only after they are saved, so a failure half-way leaves no trainer whose weights moved
past the last checkpoint (the retry rebuilds from the committed checkpoint and equals a run never failed).

Pipelined iterations (pipeline.max_staleness >= 1) run stages of several iterations in threads of one process:
`borrowed` lets the rollout copy the trainer's weights while the next update waits to take it, and
`stage_lock(stage)` runs one rollout (or one score) at a time, as one engine serves them.

The rollout engines have their own registry (engines/rollout/registry.py) because they refresh weights in
place instead of being rebuilt.
"""

from __future__ import annotations

import enum
import os
import socket
import threading
from collections import Counter, defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Optional, TypeVar

T = TypeVar("T")


class Role(str, enum.Enum):
    PROMPTS = "prompts"
    EVAL_PROMPTS = "eval-prompts"  # the eval stage's held-out prompts (stages/held.py)
    SCORER = "scorer"
    SCORE_CACHE = "score-cache"
    TRAINER = "trainer"
    RM_DATA = "rm-data"  # reward-model training (stages/reward_model.py): tokenised preference pairs
    RM_TRAINER = "rm-trainer"


class WarmKey(NamedTuple):
    role: Role
    identity: str


_lock = threading.Lock()
_entries: dict[Role, tuple[str, Any]] = {}
_builds: Counter = Counter()  # role (or "rollout") -> engines built in this process
_role_locks: defaultdict[Role, threading.RLock] = defaultdict(threading.RLock)  # held by borrowed/take/put
_stage_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)


def count_build(kind: str) -> None:
    """Record that this process built an engine of `kind` (the rollout registry reports its builds here)."""
    with _lock:
        _builds[kind] += 1


def engine_builds() -> int:
    """Engines built in this process so far: a warm worker builds each once, a cold one every stage."""
    with _lock:
        return sum(_builds.values())


def worker_tag() -> str:
    """host:pid of this process, as stage manifests name the worker that ran them."""
    return f"{socket.gethostname()}:{os.getpid()}"


def get_or_build(key: WarmKey, build: Callable[[], T]) -> T:
    """The engine held for `key.role` if it was built for `key.identity`, else a new one from `build()`."""
    with _lock:
        entry = _entries.get(key.role)
        if entry is not None and entry[0] == key.identity:
            return entry[1]
        _entries.pop(key.role, None)  # dropped before the build: two models of one role never coexist
    engine = build()
    with _lock:
        _entries[key.role] = (key.identity, engine)
        _builds[key.role.value] += 1
    return engine


def peek(key: WarmKey) -> Optional[Any]:
    """The engine held for `key.role` if it is for `key.identity`, else None. The registry keeps it."""
    with _lock:
        entry = _entries.get(key.role)
    return entry[1] if entry is not None and entry[0] == key.identity else None


def take(key: WarmKey) -> Optional[Any]:
    """Remove the role's engine; return it if it was for `key.identity`, else None (and it is dropped).
    Waits while another thread has it `borrowed`."""
    with _role_locks[key.role], _lock:
        entry = _entries.pop(key.role, None)
    return entry[1] if entry is not None and entry[0] == key.identity else None


def put(key: WarmKey, engine: Any) -> None:
    """Hold `engine` for `key.role` as `key.identity`, replacing whatever the role held."""
    with _role_locks[key.role], _lock:
        _entries[key.role] = (key.identity, engine)


@contextmanager
def borrowed(key: WarmKey) -> Iterator[Optional[Any]]:
    """Yield `peek(key)`; until the block ends no other thread can take or replace the role's engine, so the
    block may read its state (copy a trainer's weights) while another thread waits to train it."""
    with _role_locks[key.role]:
        yield peek(key)


@contextmanager
def stage_lock(stage: str) -> Iterator[None]:
    """Run one `stage` at a time in this process: pipelined iterations share one rollout engine and one scorer."""
    with _stage_locks[stage]:
        yield


def invalidate(role: Optional[Role] = None) -> None:
    """Forget one role's engine (or all); the next get_or_build rebuilds it."""
    with _lock:
        if role is None:
            _entries.clear()
        else:
            _entries.pop(Role(role), None)
