"""A reward function in a worker process of its own, so that a call that hangs can be stopped.

A thread cannot be killed: a timed-out call in a worker thread runs on (a code-execution reward stuck in a
loop burns a core until the process ends, and each retry of the stage adds one more). A process can. With
`isolation: process` a function reward source calls its function in one long-lived worker process
(`python -m engines.rewards.isolated_worker`); on a timeout the worker is killed with SIGKILL and the next call
starts a new one.

Protocol (between our own two processes, over the worker's stdin and stdout; nothing is stored): frames of
an 8-byte little-endian length and a pickle. The first frame is the init {"spec", "sys_path"}; the worker
answers ("ready", None) or ("error", type name, message). Each call frame is (args, kwargs); the answer is
("ok", result), ("error", type name, message) or ("exited", "called sys.exit(3)") (SystemExit is answered
and the worker serves on). The worker writes frames on a duplicate of its stdout and
points fd 1 at stderr, so a function that prints cannot corrupt the protocol. It exits when its stdin
closes, and on Linux also when the thread that started it dies (PR_SET_PDEATHSIG), so a worker stuck in a
loop does not outlive its trainer.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from typing import Any, Optional

from engines.rewards.threaded import FunctionExited

_LENGTH = struct.Struct("<Q")
START_TIMEOUT_S = 120.0  # interpreter start and the reward module's imports (torch, say) on a loaded machine
EXIT_WAIT_S = 5.0  # a worker whose pipe closed mid-call is exiting: its exit code says how it died


def describe_exit(code: int) -> str:
    """How a process ended, from its return code: "was killed by signal SIGKILL (9)", "exited with code 1"."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by signal {name} ({-code})"
    return f"exited with code {code}"


class WorkerTimeout(TimeoutError):
    """The call did not answer within its timeout; the worker was killed."""


class WorkerFailed(RuntimeError):
    """The worker could not start, could not import the function, or died during a call (os._exit, a signal,
    a segfault: the message gives its exit code or signal)."""


class FunctionRaised(RuntimeError):
    """The function raised; `type_name` and `message` are its exception's."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message = type_name, message


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


def _read_exactly(fd: int, size: int, deadline: Optional[float]) -> bytes:
    """`size` bytes from `fd`; TimeoutError when the deadline passes first, EOFError when the writer closed."""
    chunks, have = [], 0
    while have < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        chunk = os.read(fd, size - have)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: Optional[float] = None) -> Any:
    (size,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size, deadline))
    return pickle.loads(_read_exactly(fd, size, deadline))


class ProcessCaller:
    """Calls the function named by `spec` in a worker process; see the module docstring.

    `call(timeout_s, *args, **kwargs)` returns the function's result (`.tolist()` of a tensor or array),
    raises FunctionRaised when the function raised, FunctionExited when it called sys.exit, WorkerTimeout
    after killing a worker that did not answer in time, WorkerFailed when the worker cannot start or import
    the function, or died.
    """

    def __init__(self, spec: str):
        self.spec = spec
        self._proc: Optional[subprocess.Popen] = None

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engines.rewards.isolated_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=os.getcwd(),
        )
        try:
            self._send(proc, {"spec": self.spec, "sys_path": list(sys.path)})
            answer = _read_frame(proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError) as e:
            _kill(proc)
            why = f"no answer in {START_TIMEOUT_S:.0f} s" if isinstance(e, TimeoutError) else "it exited"
            raise WorkerFailed(
                f"the reward worker for {self.spec!r} did not start ({why}, exit code "
                f"{proc.returncode}); its stderr is above"
            ) from None
        if answer[0] != "ready":
            _kill(proc)
            raise WorkerFailed(f"the reward worker could not load {self.spec!r}: {answer[1]}: {answer[2]}")
        return proc

    @staticmethod
    def _send(proc: subprocess.Popen, obj: Any) -> None:
        proc.stdin.write(_frame(obj))
        proc.stdin.flush()

    def call(self, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
        if self._proc is None or self._proc.poll() is not None:  # first call, or the last worker is gone
            self._proc = self._start()
        proc = self._proc
        try:
            self._send(proc, (args, kwargs))
            answer = _read_frame(proc.stdout.fileno(), time.monotonic() + timeout_s)
        except TimeoutError:
            _kill(proc)
            self._proc = None
            raise WorkerTimeout(f"no answer in {timeout_s} s; worker {proc.pid} killed") from None
        except (EOFError, BrokenPipeError):
            try:  # its pipe closes as it exits: wait for the exit code rather than kill it and report our signal
                proc.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
            _kill(proc)
            self._proc = None
            raise WorkerFailed(
                f"the reward worker {proc.pid} {describe_exit(proc.returncode)} during the call"
            ) from None
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "exited":
            raise FunctionExited(answer[1])
        raise FunctionRaised(answer[1], answer[2])

    def close(self) -> None:
        if self._proc is not None:
            _kill(self._proc)
            self._proc = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit modules may be half torn down; the worker dies with its pipe
            pass


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass
