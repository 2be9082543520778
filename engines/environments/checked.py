"""One environment, held to its contract: every failure becomes one error naming the environment, the row
and the turn.

The rollout driver talks to environments only through this wrapper:

    env = CheckedEnvironment.start(factory, row_index=17, sample_index=2)   # factory: load_environment_factory
    try:
        first = env.reset(row)            # str or None
        ...
        obs = env.step(messages)          # a validated Observation; env.turn is its 1-based policy turn
    finally:
        env.close()

What becomes an EnvironmentFailed (message: "environment 'spec' (row 17, sample 2) turn 3: ..."):
- the factory raising or building something without reset/step/close;
- reset, step or close raising (the exception is chained), or calling sys.exit / os._exit;
- reset returning anything but a non-empty str or None; step returning anything but an Observation, or one
  whose fields break base.py's types (text str, role "user"/"tool", reward a finite number, done a bool,
  info a JSON-able mapping whose "is_success", when present, is a bool);
- a call that does not return within `call_timeout_s`: each call runs in this environment's own daemon
  thread (engines/rewards/threaded.py ThreadCaller), abandoned on a timeout, so a hung environment fails
  its sample instead of stalling the rollout. `call_timeout_s=None` calls inline (for environments that
  need the calling thread, e.g. signal-based timeouts);
- step called again after it returned done (a driver bug, named rather than passed to the environment).
An episode that never says done is not an error here: the driver stops it at its turn limit and records a
truncation (base.py).
"""

from __future__ import annotations

import json
import math
from numbers import Real
from typing import Any, Callable, Mapping, Optional

from engines.environments.base import Message, Observation
from engines.environments.loader import EnvironmentFactory
from engines.rewards.threaded import CallTimedOut, FunctionExited, ThreadCaller

DEFAULT_CALL_TIMEOUT_S = 120.0  # one reset or step; a tool call inside it has its own, shorter, timeout


class EnvironmentFailed(RuntimeError):
    """An environment broke its contract; the message names the environment, the row and the turn."""


def _invoke(method: Callable, args: tuple) -> Any:
    return method(*args)


class CheckedEnvironment:
    """Wraps one Environment instance (one sample); see the module docstring."""

    def __init__(
        self,
        env: Any,
        spec: str,
        row_index: int,
        sample_index: Optional[int] = None,
        call_timeout_s: Optional[float] = DEFAULT_CALL_TIMEOUT_S,
    ):
        self.env, self.spec = env, spec
        self.row_index, self.sample_index = row_index, sample_index
        self.call_timeout_s = call_timeout_s
        self.turn = 0  # policy turns stepped so far; the failing step's number in errors
        self.done = False
        self._closed = False
        self._stuck = False  # a call timed out: its thread may still be inside the environment
        self._caller = ThreadCaller(_invoke, f"env-row-{row_index}") if call_timeout_s is not None else None
        missing = [m for m in ("reset", "step", "close") if not callable(getattr(env, m, None))]
        if missing:
            raise self._error("factory", f"built a {type(env).__name__} without {', '.join(missing)}")

    @classmethod
    def start(
        cls,
        factory: EnvironmentFactory,
        row_index: int,
        sample_index: Optional[int] = None,
        call_timeout_s: Optional[float] = DEFAULT_CALL_TIMEOUT_S,
    ) -> "CheckedEnvironment":
        """Build a fresh environment with `factory.make()`; EnvironmentFailed if the factory raises."""
        try:
            env = factory.make()
        except Exception as e:
            where = cls._where(factory.spec, row_index, sample_index)
            raise EnvironmentFailed(f"{where} factory: raised {type(e).__name__}: {e}") from e
        return cls(env, factory.spec, row_index, sample_index, call_timeout_s)

    @staticmethod
    def _where(spec: str, row_index: int, sample_index: Optional[int]) -> str:
        sample = "" if sample_index is None else f", sample {sample_index}"
        return f"environment {spec!r} (row {row_index}{sample})"

    def _error(self, when: str, what: str) -> EnvironmentFailed:
        return EnvironmentFailed(f"{self._where(self.spec, self.row_index, self.sample_index)} {when}: {what}")

    def _call(self, when: str, method: Callable, *args: Any) -> Any:
        """`method(*args)` under the timeout; every failure an EnvironmentFailed naming `when`."""
        if self._stuck:
            raise self._error(when, "not called: an earlier call of this environment never returned")
        try:
            if self._caller is None:
                return method(*args)
            return self._caller.call(self.call_timeout_s, method, args)
        except CallTimedOut:
            self._stuck = True  # nothing more can be asked of this instance, not even inline
            raise self._error(when, f"did not return within {self.call_timeout_s} s (abandoned)") from None
        except FunctionExited as e:
            raise self._error(when, f"{e} (an environment returns or raises; it cannot end the run)") from None
        except Exception as e:
            raise self._error(when, f"raised {type(e).__name__}: {e}") from e

    def reset(self, row: Mapping[str, Any]) -> Optional[str]:
        """The first user message (None: the row's prompt). EnvironmentFailed on a failure or a wrong type."""
        first = self._call("reset", self.env.reset, row)
        if first is not None and not (isinstance(first, str) and first.strip()):
            raise self._error("reset", f"returned {_show(first)}: expected a non-empty str or None")
        return first

    def step(self, messages: list[Message]) -> Observation:
        """The environment's answer to the newest assistant turn, validated; advances `turn`."""
        if self.done:
            raise self._error(f"turn {self.turn + 1}", "step called after the episode returned done")
        self.turn += 1
        when = f"turn {self.turn}"
        obs = self._call(when, self.env.step, messages)
        problem = observation_problem(obs)
        if problem:
            raise self._error(when, f"step {problem}")
        self.done = obs.done
        return obs

    def close(self, raise_errors: bool = True) -> None:
        """Close the environment once (idempotent). With raise_errors=False (in a `finally` after another
        error, which must not be masked) a failing close is dropped."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stuck:
                return  # the stuck thread still holds the environment: closing it under that call would race
            self._call("close", self.env.close)
        except EnvironmentFailed:
            if raise_errors:
                raise
        finally:
            if self._caller is not None:
                self._caller.close()


def observation_problem(obs: Any) -> Optional[str]:
    """What is wrong with a step's return value (a phrase starting "returned ..."), or None if it is valid."""
    if not isinstance(obs, Observation):
        return f"returned {_show(obs)}: expected an engines.environments.base.Observation"
    checks = [
        (isinstance(obs.text, str), f"text {_show(obs.text)}: expected a str"),
        (obs.role in ("user", "tool"), f"role {obs.role!r}: expected 'user' or 'tool'"),
        (isinstance(obs.done, bool), f"done {_show(obs.done)}: expected a bool"),
        (
            isinstance(obs.reward, Real) and not isinstance(obs.reward, bool) and math.isfinite(obs.reward),
            f"reward {_show(obs.reward)}: expected a finite number",
        ),
        (isinstance(obs.info, Mapping), f"info {_show(obs.info)}: expected a mapping"),
    ]
    for ok, what in checks:
        if not ok:
            return f"returned an Observation with {what}"
    try:
        json.dumps(dict(obs.info), allow_nan=False)
    except (TypeError, ValueError) as e:
        return f"returned an Observation whose info is not JSON-able ({e})"
    if not isinstance(obs.info.get("is_success", False), bool):  # eval's success flag (base.py): a bool or absent
        return f"returned an Observation with info['is_success'] {_show(obs.info['is_success'])}: expected a bool"
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


__all__ = ["CheckedEnvironment", "EnvironmentFailed", "observation_problem"]
