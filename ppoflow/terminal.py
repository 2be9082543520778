"""The user's terminal, for the last words of a process that is about to end without unwinding.

`ppoflow train` points fds 1 and 2 at the run's log file (flows/logs.py) and shows the user its own display on a
duplicate of the original stdout. Code far below the CLI that must end the process at once (a stage blocked past
its deadline: tasks/deadlines.py) cannot raise to the CLI's one message, so it says its line here: on that
terminal when the CLI registered one, and always on stderr (the log, or the terminal when nothing captures).
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

_terminal: dict[str, Optional[TextIO]] = {"stream": None}


def use_terminal(stream: Optional[TextIO]) -> None:
    """Register the stream the user sees (None: none, stderr is the terminal)."""
    _terminal["stream"] = stream


def last_words(line: str) -> None:
    """Write `line` to stderr and, when one is registered, to the user's terminal; flushed, never raising."""
    for stream in (sys.stderr, _terminal["stream"]):
        if stream is None:
            continue
        try:
            stream.write(line.rstrip("\n") + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed terminal: the log still has the line
            pass
