"""How a command that trains runs: its output captured to the run's log file (flows/logs.py), one message when it
fails (flows/failure.py: what failed, where, the log file, the command that resumes), SIGTERM unwound as Ctrl-C, and
the process gone within STOP_GRACE_S of it.

    run_with_capture(cfg, "train", args, body) -> exit code: 0, 1 (a failure), 2 (ConfigError), 130 (Ctrl-C),
                                                  128 + SIGTERM (terminated)
"""

from __future__ import annotations

import os
import sys
import threading

from ppoflow.config import ConfigError, PPOFlowConfig

# After SIGTERM: how long the interpreter's own shutdown may take (it joins every non-daemon thread, e.g. a stage task
# still running, then runs the atexit hooks) before the process exits regardless. Batch schedulers and Kubernetes
# follow SIGTERM with SIGKILL after 30 s by default; nothing committed depends on the rest (commits are atomic).
STOP_GRACE_S = 20.0


def exit_within(seconds: float, status: int) -> threading.Thread:
    """Make this process exit with `status` `seconds` from now, whatever its other threads still do (a daemon
    thread, which the interpreter's shutdown does not wait for); returns that thread."""

    def hard_exit() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: exit all the same
                pass
        os._exit(status)

    timer = threading.Timer(seconds, hard_exit)
    timer.daemon = True
    timer.name = "ppoflow-stop-grace"
    timer.start()
    return timer


def run_with_capture(cfg: PPOFlowConfig, command: str, args, body) -> int:
    """Run `body(console)` with the run's output captured (flows/logs.py); one message if it fails."""
    import signal

    from rich.console import Console

    from flows.failure import Terminated, describe_failure, log_traceback, raise_on_sigterm
    from flows.logs import capture_output, terminal_width

    width = terminal_width(1)
    capture = capture_output(cfg, command, verbose=args.verbose)
    console = Console(file=capture.terminal, width=width)
    previous = raise_on_sigterm()
    try:
        body(console)
        return 0
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        log_traceback(e)
        console.print(describe_failure(e, cfg, capture.log_path), highlight=False, markup=False, soft_wrap=True)
        if isinstance(e, Terminated):
            exit_within(STOP_GRACE_S, 128 + signal.SIGTERM)  # the log is published below, well within it
            return 128 + signal.SIGTERM
        return 130
    except Exception as e:  # noqa: BLE001 - every failure gets the one message; the traceback goes to the log
        log_traceback(e)
        console.print(describe_failure(e, cfg, capture.log_path), highlight=False, markup=False, soft_wrap=True)
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        capture.publish(cfg.storage)
