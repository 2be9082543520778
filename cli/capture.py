"""How a command that trains runs: its output captured to the run's log file (flows/logs.py), one message when it
fails (flows/failure.py: what failed, where, the log file, the command that resumes), SIGTERM unwound as Ctrl-C.

    run_with_capture(cfg, "train", args, body) -> exit code: 0, 1 (a failure), 2 (ConfigError), 130 (Ctrl-C),
                                                  128 + SIGTERM (terminated)
"""

from __future__ import annotations

from ppoflow.config import ConfigError, PPOFlowConfig


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
        return 128 + signal.SIGTERM if isinstance(e, Terminated) else 130
    except Exception as e:  # noqa: BLE001 - every failure gets the one message; the traceback goes to the log
        log_traceback(e)
        console.print(describe_failure(e, cfg, capture.log_path), highlight=False, markup=False, soft_wrap=True)
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        capture.publish(cfg.storage)
