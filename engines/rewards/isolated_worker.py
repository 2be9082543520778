"""The worker process of an isolated reward function (`python -m engines.rewards.isolated_worker`): loads the
function named in the init frame, then answers call frames until its stdin closes. The protocol and the caller
(ProcessCaller) are in engines/rewards/isolated.py.

Its own module because it loads the function (engines/rewards/function.py), which itself uses the caller: the
caller's module and function.py would otherwise import each other.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, BinaryIO

from engines.rewards.function import load_reward_function
from engines.rewards.isolated import _frame, _read_frame
from engines.rewards.threaded import describe_exit_request


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the thread that started it exits (no effect elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _answer(out: BinaryIO, obj: Any) -> None:
    out.write(_frame(obj))
    out.flush()


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """The worker's loop (see the module docstring); returns when its input closes."""
    import asyncio
    import inspect

    try:
        init = _read_frame(inp.fileno())
    except EOFError:
        return
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    try:
        fn = load_reward_function(init["spec"])
    except Exception as e:  # the parent reports it, naming the spec
        _answer(out, ("error", type(e).__name__, str(e)))
        return
    _answer(out, ("ready", None))
    is_async = inspect.iscoroutinefunction(fn)
    while True:
        try:
            args, kwargs = _read_frame(inp.fileno())
        except EOFError:
            return
        try:
            result = asyncio.run(fn(*args, **kwargs)) if is_async else fn(*args, **kwargs)
            if isinstance(result, dict) and hasattr(result.get("rewards"), "tolist"):
                result = dict(result, rewards=result["rewards"].tolist())
            elif hasattr(result, "tolist"):
                result = result.tolist()
            _answer(out, ("ok", result))
        except SystemExit as e:  # the function's sys.exit ends its call, not the worker
            _answer(out, ("exited", describe_exit_request(e)))
        except Exception as e:
            _answer(out, ("error", type(e).__name__, str(e)))


def main() -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the function's prints go to stderr, not into the protocol
    sys.stdout = sys.stderr
    serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
