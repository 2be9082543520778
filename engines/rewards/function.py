"""Rewards from a user's Python function, in the two contracts people already have.

A function is named by a spec: `path/to/file.py:fn` (a file, imported under a private module name) or
`pkg.module:fn` (importable). Its contract is told from its signature:

- OpenRLHF: `reward_func(queries, prompts, labels, **kwargs)` -> {"rewards": [...]} or a list / tensor;
  called once per batch of `batch_size` samples (queries = prompt + response text).
- veRL: `compute_score(data_source, solution_str, ground_truth, extra_info)` -> float or {"score": float};
  called once per sample (solution_str = response text).

`async def` functions are awaited. Every call has a timeout. Where the function runs (`isolation`):
- "thread" (default): a daemon worker thread of this process (engines/rewards/threaded.py); cheapest, but a
  thread cannot be killed, so a timed-out call is abandoned (it runs on; the process can still exit, and a
  retried stage does not wait for it) and a fresh thread serves the next call;
- "process": a worker process (engines/rewards/isolated.py), killed on a timeout and replaced at the next
  call; for functions that may hang (running generated code, say).
A wrong number of rewards, a non-finite reward, an exception or a timeout is a RewardError naming the
source and the sample, never a silent zero. So is a function that tries to end the run (`sys.exit(3)`,
`os._exit(7)`, both caught in the worker thread) or whose worker process dies (a segfault, a signal, an
exit): the stage fails with that message and the run can be resumed; nothing committed is touched. In a
thread, a crash in native code or a signal still ends the whole process without a word: such code needs
isolation "process".
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from engines.rewards.base import RewardBatch, RewardError
from engines.rewards.isolated import FunctionRaised, ProcessCaller, WorkerFailed, WorkerTimeout
from engines.rewards.threaded import CallTimedOut, FunctionExited, ThreadCaller, guard_os_exit

Contract = Literal["openrlhf", "verl"]


def load_reward_function(spec: str) -> Callable:
    """The callable named by `spec` ("path/to/file.py:fn" or "pkg.module:fn").

    Raises ValueError (malformed spec), FileNotFoundError (file missing), ImportError (module missing or
    failing to import), AttributeError (no such function) or TypeError (not callable), each naming spec.
    """
    return load_by_spec(spec, "reward function")


def load_by_spec(spec: str, kind: str) -> Callable:
    """The callable named by `spec` ("path/to/file.py:name" or "pkg.module:name"), for a `kind` of user code
    ("reward function", "environment", "tool"): the one import rule that reward functions, environment
    factories and tools share. Errors as `load_reward_function`'s, each naming the kind and the spec.
    """
    usage = f"{kind} spec {spec!r} must be 'path/to/file.py:fn' or 'pkg.module:fn'"
    if ":" not in spec:
        raise ValueError(usage)
    where, attr = spec.rsplit(":", 1)
    if not where or not attr:
        raise ValueError(usage)
    if is_file_spec(where):
        module = _import_file(where, spec, kind)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ImportError(f"{kind} {spec!r}: cannot import module {where!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise AttributeError(f"{kind} {spec!r}: {where!r} has no attribute {attr!r}")
    if not callable(fn):
        raise TypeError(f"{kind} {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def is_file_spec(where: str) -> bool:
    """Whether the part of a spec before its ':' names a file ("dir/x.py") rather than a module ("pkg.x")."""
    return where.endswith(".py") or "/" in where or "\\" in where


def _import_file(file: str, spec: str, kind: str):
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{kind} {spec!r}: file {file!r} not found")
    name = "ppoflow_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's module failed at import time: say which file
        raise ImportError(f"{kind} {spec!r}: importing {file!r} failed: {type(e).__name__}: {e}") from e
    return module


def detect_contract(fn: Callable, spec: str) -> Contract:
    """ "openrlhf" when the first parameter is `queries`, "verl" when `solution_str` is a parameter."""
    params = list(inspect.signature(fn).parameters)
    if params and params[0] == "queries":
        return "openrlhf"
    if "solution_str" in params:
        return "verl"
    raise TypeError(
        f"reward function {spec!r} has parameters {params}: expected OpenRLHF's "
        f"(queries, prompts, labels, **kwargs) or veRL's (data_source, solution_str, ground_truth, extra_info)"
    )


def spec_file(spec: str) -> Optional[Path]:
    """The file a spec's code lives in: the file a "path/to/file.py:name" spec names, or the file of the module a
    "pkg.module:name" spec imported (None when that module is not imported or has no file)."""
    where = spec.rsplit(":", 1)[0]
    if is_file_spec(where):
        file = Path(where).expanduser()
    else:  # the module the spec imported, even when the name is one it re-exports
        file = Path(getattr(sys.modules.get(where), "__file__", None) or "")
    return file if file.is_file() else None


def function_identity(spec: str, fn: Callable) -> str:
    """sha256 of the spec and the whole file the function lives in (so an edit to a helper it calls changes
    the identity too): the file a file spec names (its module is imported under a private name that is not in
    sys.modules, so inspect cannot find it), the defining module's file for a module spec; the function's own
    source when there is no file."""
    if is_file_spec(spec.rsplit(":", 1)[0]):
        file = spec_file(spec)
    else:
        file = Path(getattr(inspect.getmodule(fn), "__file__", None) or "")
    if file is not None and file.is_file():
        code = file.read_bytes()
    else:
        try:
            code = inspect.getsource(fn).encode()
        except (OSError, TypeError):
            code = repr(fn).encode()
    return hashlib.sha256(f"{spec}\n".encode() + code).hexdigest()[:16]


class FunctionRewardSource:
    """RewardSource over a Python function. See the module docstring for the contracts and errors."""

    reward_inputs = ("label", "data_source")  # both contracts pass them to the function

    def __init__(
        self,
        spec: str,
        timeout_s: float = 60.0,
        batch_size: int = 64,
        name: Optional[str] = None,
        isolation: Literal["thread", "process"] = "thread",
    ):
        if batch_size < 1 or not timeout_s > 0:
            raise ValueError(
                f"reward function {spec!r}: batch_size must be >= 1 and timeout_s > 0 (got {batch_size}, {timeout_s})"
            )
        if isolation not in ("thread", "process"):
            raise ValueError(f"reward function {spec!r}: isolation must be 'thread' or 'process', got {isolation!r}")
        self.spec = spec
        if isolation == "thread":
            guard_os_exit()  # before the import: a module that binds `from os import _exit` gets the guard
        self.fn = load_reward_function(spec)
        self.contract = detect_contract(self.fn, spec)
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.name = name or "function"
        self.identity = function_identity(spec, self.fn)
        self.isolation = isolation
        self._process = ProcessCaller(spec) if isolation == "process" else None
        self._thread = ThreadCaller(self.fn, f"reward-fn-{self.name}") if self._process is None else None

    def close(self) -> None:
        """Stop the worker process (isolation "process") or let the worker thread end; idempotent."""
        if self._process is not None:
            self._process.close()
        if self._thread is not None:
            self._thread.close()

    def score(self, batch: RewardBatch) -> list[float]:
        rewards: list[float] = []
        for start in range(0, len(batch), self.batch_size):
            stop = min(start + self.batch_size, len(batch))
            if self.contract == "openrlhf":
                rewards.extend(self._score_openrlhf(batch, start, stop))
            else:
                rewards.extend(self._score_verl(batch, i) for i in range(start, stop))
        return rewards

    def _sample_name(self, batch: RewardBatch, i: int) -> str:
        return batch.sample_ids[i] if i < len(batch.sample_ids) else f"sample {i} of the batch"

    def _call(self, what: str, *args, **kwargs) -> Any:
        """Run the function with the timeout; RewardError naming `what` on exception or timeout."""
        if self._process is not None:
            return self._call_in_process(what, *args, **kwargs)
        try:
            return self._thread.call(self.timeout_s, *args, **kwargs)
        except CallTimedOut:
            raise RewardError(
                f"reward source {self.name!r} ({self.spec}) timed out after {self.timeout_s} s "
                f"on {what} (the call was abandoned and may still run in a thread: "
                f"isolation: process kills it instead)"
            ) from None
        except FunctionExited as e:
            raise RewardError(
                f"reward source {self.name!r} ({self.spec}) {e} on {what} (stopped in its worker thread "
                f"before it ended the run; a reward function returns its rewards or raises)"
            ) from None
        except Exception as e:
            raise RewardError(
                f"reward source {self.name!r} ({self.spec}) raised {type(e).__name__}: {e} on {what}"
            ) from e

    def _call_in_process(self, what: str, *args, **kwargs) -> Any:
        try:
            return self._process.call(self.timeout_s, *args, **kwargs)
        except WorkerTimeout as e:
            raise RewardError(
                f"reward source {self.name!r} ({self.spec}) timed out after {self.timeout_s} s on {what} ({e})"
            ) from None
        except FunctionRaised as e:
            raise RewardError(
                f"reward source {self.name!r} ({self.spec}) raised {e.type_name}: {e.message} on {what}"
            ) from None
        except FunctionExited as e:
            raise RewardError(f"reward source {self.name!r} ({self.spec}) {e} on {what}") from None
        except WorkerFailed as e:
            raise RewardError(f"reward source {self.name!r} ({self.spec}): {e} on {what}") from None

    def _score_openrlhf(self, batch: RewardBatch, start: int, stop: int) -> list[float]:
        what = f"{self._sample_name(batch, start)} .. {self._sample_name(batch, stop - 1)}"
        labels = list(batch.labels[start:stop]) if batch.labels else [None] * (stop - start)
        result = self._call(
            what,
            batch.queries[start:stop],
            batch.prompts[start:stop],
            labels,
            data_sources=batch.data_sources[start:stop] if batch.data_sources else None,
        )
        values = result.get("rewards") if isinstance(result, dict) else result
        if values is None:
            raise RewardError(f"reward source {self.name!r} ({self.spec}) returned a dict without 'rewards' on {what}")
        if hasattr(values, "tolist"):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != stop - start:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(
                f"reward source {self.name!r} ({self.spec}) returned {got} rewards for {stop - start} samples on {what}"
            )
        return [self._finite(v, batch, start + k) for k, v in enumerate(values)]

    def _score_verl(self, batch: RewardBatch, i: int) -> float:
        what = self._sample_name(batch, i)
        data_source = batch.data_sources[i] if batch.data_sources else None
        label = batch.labels[i] if batch.labels else None
        result = self._call(what, data_source, batch.responses[i], label, {"prompt": batch.prompts[i]})
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(
                    f"reward source {self.name!r} ({self.spec}) returned a dict without 'score' on {what}"
                )
            result = result["score"]
        return self._finite(result, batch, i)

    def _finite(self, value: Any, batch: RewardBatch, i: int) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(
                f"reward source {self.name!r} ({self.spec}) returned {value!r} (not a number) "
                f"for {self._sample_name(batch, i)}"
            ) from None
        if not math.isfinite(number):
            raise RewardError(
                f"reward source {self.name!r} ({self.spec}) returned {number} for {self._sample_name(batch, i)}"
            )
        return number
