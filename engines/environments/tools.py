"""Tools that an environment calls on the policy's behalf, each call in a sealed worker process.

A tool is a plain function of JSON-able arguments returning something `str()` can show ("pkg.module:fn" or
"path/file.py:fn", imported by the rule reward functions use). SandboxedTool runs it the way reward functions
with `isolation: process` run (engines/rewards/isolated.py ProcessCaller: one long-lived worker process,
killed with SIGKILL on a timeout and started afresh at the next call), and seals that worker before the tool's
module is even imported:

- memory: RLIMIT_AS is set to the worker's size at sealing plus `memory_mb`, so an allocation beyond it raises
  MemoryError in the tool (or kills the worker, when native code does not check);
- network: the worker moves into a network namespace of its own (unshare(CLONE_NEWNET), or with
  CLONE_NEWUSER where the process is not root): no interface but a loopback that is down, so nothing, native
  code and child processes included, reaches another machine. Where the kernel refuses namespaces, an audit
  hook refusing Python's socket calls is all there is; `SandboxedTool.sealing` says which one a worker got;
- time: each call has `timeout_s`; a worker that overruns it is killed.

A tool's failure is the policy's business, not the run's: `call` never raises for it, it returns a ToolResult
whose `error` names the call ("calculator('9**9**9') timed out after 2.0 s; its worker was killed") and whose
`text` is what the policy sees. A tool that cannot be loaded at all (a wrong spec) is the run's business:
`call` raises ToolUnavailable, which CheckedEnvironment turns into an error naming the row and the turn.

Workers are shared by every SandboxedTool of one (spec, limits) in a process, one call at a time: a tool must
be a function of its arguments only (the calculator is; state one call leaves in the worker is not reset).
Every call is made from one long-lived thread of this module: a worker dies with the thread that started it
(PR_SET_PDEATHSIG, isolated.py), and CheckedEnvironment runs each environment on a thread of its own that ends
with the episode, so a worker started there would be killed when that episode closed, perhaps in the middle of
another episode's call.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from engines.rewards.isolated import FunctionRaised, ProcessCaller, WorkerFailed, WorkerTimeout
from engines.rewards.threaded import FunctionExited, ThreadCaller

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MAX_SHOWN = 2000  # characters of a tool's result or error the policy is shown


@dataclass(frozen=True)
class ToolLimits:
    """timeout_s: seconds one call may take; memory_mb: MiB the tool may allocate beyond the bare worker."""

    timeout_s: float = 5.0
    memory_mb: int = 256

    def __post_init__(self):
        if not self.timeout_s > 0 or self.memory_mb < 1:
            raise ValueError(f"tool limits need timeout_s > 0 and memory_mb >= 1, got {self}")


@dataclass(frozen=True)
class ToolResult:
    """text: what the policy is shown; error: None on success, else what went wrong, naming the call."""

    text: str
    error: Optional[str] = None


class ToolUnavailable(RuntimeError):
    """The tool's worker could not start or could not import the tool: a configuration error, not the policy's."""


class SandboxedTool:
    """`call(*args)` runs the tool named by `spec` in a sealed worker (module docstring)."""

    _workers: dict[tuple[str, ToolLimits], ProcessCaller] = {}
    _workers_lock = threading.Lock()

    def __init__(self, spec: str, name: Optional[str] = None, limits: ToolLimits = ToolLimits()):
        self.spec, self.limits = spec, limits
        self.name = name or spec.rsplit(":", 1)[-1]
        with self._workers_lock:
            key = (spec, limits)
            if key not in self._workers:
                self._workers[key] = ProcessCaller(f"{__name__}:sealed_call")
            self._worker = self._workers[key]

    def call(self, *args: Any) -> ToolResult:
        """The tool's answer to `args` (JSON-able values), or a ToolResult with `error` set; see the module."""
        shown = ", ".join(_clip(repr(a), 60) for a in args)
        what = f"{self.name}({shown})"
        try:
            result = _on_the_tool_thread(self._worker, self.limits.timeout_s, self.spec, self.limits.memory_mb, args)
        except WorkerTimeout:
            return _failed(f"{what} timed out after {self.limits.timeout_s} s; its worker was killed")
        except FunctionRaised as e:
            if e.type_name == "ToolUnavailable":
                raise ToolUnavailable(f"tool {self.spec!r}: {e.message}") from None
            return _failed(f"{what} raised {e.type_name}: {e.message}")
        except FunctionExited as e:
            return _failed(f"{what} {e}")
        except WorkerFailed as e:
            if "during the call" in str(e):  # the worker died in the tool: a crash the policy caused
                return _failed(f"{what} crashed: {str(e).replace('the reward worker', 'its worker')}")
            raise ToolUnavailable(f"tool {self.spec!r}: {e}") from None
        return ToolResult(text=_clip(str(result), _MAX_SHOWN))

    @property
    def sealing(self) -> str:
        """How the current worker is sealed ("network namespace" or "audit hook"); starts one if needed."""
        return _on_the_tool_thread(self._worker, self.limits.timeout_s, "", self.limits.memory_mb, ())


_tool_thread = ThreadCaller(lambda worker, *args: worker.call(*args), "ppoflow-tool-calls")
_tool_thread_lock = threading.Lock()


def _on_the_tool_thread(worker: ProcessCaller, *args: Any) -> Any:
    """`worker.call(*args)` on the module's one tool thread (module docstring), one call at a time. No timeout
    here: ProcessCaller's own kills a worker that overruns the call's."""
    with _tool_thread_lock:
        return _tool_thread.call(None, worker, *args)


def _failed(error: str) -> ToolResult:
    error = _clip(error, _MAX_SHOWN)
    return ToolResult(text=f"Error: {error}", error=error)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- inside the worker process -------------------------------------------------------------------------------

_sealed: Optional[str] = None
_tools: dict[str, Callable] = {}


def sealed_call(spec: str, memory_mb: int, args: tuple) -> Any:
    """Worker side: seal this process on its first call, then call the tool `spec` with `args`.

    An empty `spec` returns the sealing ("network namespace" or "audit hook") instead of calling a tool.
    Raises ToolUnavailable (reported by name to the parent) when the tool cannot be loaded.
    """
    global _sealed
    if _sealed is None:
        _sealed = _seal(memory_mb)
    if not spec:
        return _sealed
    if spec not in _tools:
        from engines.rewards.function import load_by_spec

        try:
            _tools[spec] = load_by_spec(spec, "tool")
        except Exception as e:
            raise ToolUnavailable(f"{type(e).__name__}: {e}") from None
    return _tools[spec](*args)


def _seal(memory_mb: int) -> str:
    """Cut this worker off the network and cap its memory; returns how the network was cut."""
    network = "network namespace" if _unshare_network() else "audit hook"
    sys.addaudithook(_refuse_sockets)
    size = _virtual_size_bytes()
    cap = size + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return network


def _unshare_network() -> bool:
    """Move into a new network namespace; False where the kernel refuses (no privileges, no user namespaces)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
    return libc.unshare(flags) == 0


def _refuse_sockets(event: str, args: tuple) -> None:
    if event.startswith("socket.") and event != "socket.gethostname":
        raise PermissionError(f"network access is off for tools ({event})")


def _virtual_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status: the tool sandbox needs Linux")
