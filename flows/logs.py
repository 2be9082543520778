"""Where a run's own output goes: the terminal shows ppoflow's progress; everything else goes to a log file.

`ppoflow train` and `ppoflow demo` print a progress bar and the iteration table. The engines and Prefect
print far more (vLLM's start-up report, transformers' loading bars and LOAD REPORT blocks, DeepSpeed's
banner, Prefect's state lines, Python warnings): all of it goes to `<run>/logs/<command>-<UTC time>.log`
and, for Prefect's run loggers, to the Prefect API as before. `--verbose` shows it on the terminal too.

Why file descriptors and not logging handlers: vLLM's engine core and its worker run in *spawned* child
processes that configure their own logging and write to the stdout/stderr descriptors they inherit, and
C++ code (torch, NUMA binding) writes to fd 2 directly. So `capture_output` points fds 1 and 2 of this
process at the log file (`os.dup2`) for the rest of the command, before any engine starts: every child
started later inherits the log file, whatever it configures. ppoflow's own display writes to a duplicate
of the original terminal descriptor, taken first (`OutputCapture.terminal`).

The redirection is never undone by the CLI: vLLM shuts its engine down from an `atexit` hook, after the
command returned, and would print its shutdown report on the terminal otherwise. `release()` undoes it
for callers that live on (tests, notebooks).

With `verbose`, fds 1 and 2 go to a pipe instead, and a thread copies what arrives both to the log file
and to the terminal (a `tee`); output written after the thread stopped (at interpreter exit) is lost.

A process that Prefect started to run a flow run (a Retry executed by `ppoflow serve`, a deployment's run on a
work pool) gets a log file too, `<run>/logs/flow-run-<UTC time>-<pid>.log`, started by the training flow
(`flow_run_log`), its output also left where it went (a tee).

For a run on object storage the log file is written to a local mirror folder,
`<local cache>/mirror/<root as a folder name>/<run>/logs/` (local cache = storage.local_cache_dir, else
$PPOFLOW_CACHE, else ~/.cache/ppoflow), and copied to `<run>/logs/` in the bucket when the command ends
(`OutputCapture.publish`): object stores have no append.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import sys
import threading
import time
from typing import Optional, TextIO

from ppoflow.config import PPOFlowConfig
from ppoflow.terminal import use_terminal
from storage.run_logs import log_dir_for

log = logging.getLogger("ppoflow.cli")
# The capture running in this process (at most one: fds 1 and 2 are the process's), None when none.
_active: dict[str, Optional["OutputCapture"]] = {"capture": None}


def terminal_width(fd: int) -> int:
    """Columns of the terminal on `fd`; $COLUMNS, else 120, when it is not a terminal or reports 0 columns
    (a pty nobody sized, as under `script` or some CI runners: rich would then print nothing at all)."""
    try:
        columns = os.get_terminal_size(fd).columns
    except OSError:
        columns = 0
    if columns > 0:
        return columns
    return shutil.get_terminal_size((120, 24)).columns or 120


class OutputCapture:
    """Fds 1 and 2 of this process (and of every child it starts) into `log_path`; see the module docstring.

    `terminal` is a text stream on a duplicate of the original stdout: what ppoflow shows the user.
    """

    def __init__(self, log_path: str, verbose: bool = False, remote_dir: Optional[str] = None):
        self.log_path = log_path
        self.verbose = verbose
        self.remote_dir = remote_dir
        self._saved: dict[int, int] = {}
        self._tee: Optional[threading.Thread] = None
        self.terminal: TextIO = sys.stdout

    def start(self) -> "OutputCapture":
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        self.terminal = io.TextIOWrapper(
            os.fdopen(os.dup(self._saved[1]), "wb", buffering=0), write_through=True, line_buffering=True
        )
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.verbose:
            read_fd, write_fd = os.pipe()
            self._tee = threading.Thread(
                target=_tee, args=(read_fd, log_fd, self._saved[1]), daemon=True, name="ppoflow-log-tee"
            )
            self._tee.start()
            target = write_fd
        else:
            target = log_fd
        for fd in (1, 2):
            os.dup2(target, fd)
        if not self.verbose:
            os.close(log_fd)
        else:
            os.close(write_fd)
        _note_start(self.log_path)
        use_terminal(self.terminal)  # a process ended from below (a stage past its deadline) says so there
        _active["capture"] = self
        return self

    def release(self) -> None:
        """Point fds 1 and 2 back at what they were (the children started meanwhile keep the log file)."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        use_terminal(None)
        _active["capture"] = None
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._saved = {}
        if self._tee is not None:
            self._tee.join(timeout=2)  # ends when every writer of the pipe (children too) closed it

    def publish(self, storage_cfg=None) -> Optional[str]:
        """Copy the log file to the run's `logs/` folder on object storage; returns its URL (None when local).

        Best effort: the run's result does not depend on its log, so a failed upload is logged, not raised.
        """
        if self.remote_dir is None:
            return None
        from storage import fs as fsutil

        url = f"{self.remote_dir}/{os.path.basename(self.log_path)}"
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            fs, path = fsutil.resolve(url, storage_cfg)
            fsutil.upload_file_atomic(fs, self.log_path, path)
        except Exception as e:  # noqa: BLE001 - see docstring
            log.warning("could not copy the log file to %s: %s: %s", url, type(e).__name__, e)
            return None
        return url


def _tee(read_fd: int, log_fd: int, terminal_fd: int) -> None:
    with os.fdopen(read_fd, "rb", buffering=0) as source:
        while True:
            chunk = source.read(65536)
            if not chunk:
                break
            os.write(log_fd, chunk)
            try:
                os.write(terminal_fd, chunk)
            except OSError:
                pass  # the terminal went away; the log file still gets everything
    os.close(log_fd)


def _note_start(path: str) -> None:
    print(
        f"==== ppoflow {' '.join(sys.argv[1:])} (pid {os.getpid()}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC) log {path}",
        flush=True,
    )


def log_file_name(command: str) -> str:
    """`train-20261123T093010Z.log`: one file per command; a resumed run adds a file, never overwrites one."""
    return f"{command}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.log"


def capture_output(cfg: PPOFlowConfig, command: str, verbose: bool = False) -> OutputCapture:
    """Start capturing this process's output for run `cfg` (see OutputCapture); returns the capture."""
    folder, remote = log_dir_for(cfg)
    return OutputCapture(os.path.join(folder, log_file_name(command)), verbose=verbose, remote_dir=remote).start()


def flow_run_log(cfg: PPOFlowConfig) -> Optional[OutputCapture]:
    """A run log for a process Prefect started to run a flow run of run `cfg` (a Retry executed by `ppoflow serve`,
    a deployment's run on a work pool's worker, a fork started from the UI): `<run>/logs/flow-run-<time>-<pid>.log`,
    with the output still going where it went (the serve's or the worker's stdout: a tee). None, and nothing
    started, in a process that captures already (`ppoflow train`: its own log file) and in one Prefect did not
    start for a flow run (no PREFECT__FLOW_RUN_ID: a test or a notebook calling the flow). Never released: the
    process ends with the flow run; `publish` copies the file to an S3 root at the flow's end."""
    if _active["capture"] is not None or not os.environ.get("PREFECT__FLOW_RUN_ID"):
        return None
    return capture_output(cfg, "flow-run", verbose=True)


def prepare_flow_process() -> None:
    """What an entry point that runs flows does first, before Prefect is imported (its settings are read once, at
    import): quiet the libraries at their source, and give Prefect's temporary server time to start. Without
    PREFECT_API_URL Prefect starts a local server for the run; its 20 s default start-up timeout is too short on a busy
    2-core machine (the first start runs the database migrations). Used by `ppoflow` (cli/main.py) and flows.api."""
    quiet_libraries()
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def quiet_libraries() -> None:
    """Environment settings that remove noise at its source, before any library reads them.

    - Prefect's server telemetry: its start-up heartbeat reads the `configuration` table in a DEFERRED
      SQLite transaction, then inserts the TELEMETRY_SESSION row. Other server services write in between
      at start-up, so the insert needs to upgrade a stale WAL snapshot, which SQLite refuses at once with
      SQLITE_BUSY (busy_timeout does not apply): "database is locked" (prefect/server/services/
      telemetry.py, `_fetch_or_set_telemetry_session`). The row is never written, so every start
      repeats it; and the heartbeat it prepares is a POST to a Prefect host that an offline machine cannot
      reach anyway (`ERROR | prefect.server.services.telemetry - Failed to send telemetry`). Off by default
      for every `ppoflow` command (PREFECT_SERVER_ANALYTICS_ENABLED=false, set by cli/main.py `main` before
      Prefect is imported); a value the user set is kept.
    - Python warnings from libraries still reach the log file (stderr); nothing is filtered.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
