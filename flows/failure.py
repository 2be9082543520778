"""One message per failed `ppoflow train` / `ppoflow demo`: what failed, where, and the command that resumes.

    ppoflow: error: ValueError: reward function boom.py:reward raised on row 3 ...
      where:   stage score, iteration 2, run demo at /tmp/runs/demo
      log:     /tmp/runs/demo/logs/demo-20261123T101500Z-4242.log (the traceback; --verbose shows it here)
      resume:  ppoflow demo --root /tmp/runs
      retry:   http://127.0.0.1:4200/runs/flow-run/<id> (Retry in the Prefect UI, ...), with `ppoflow serve` running

The stage and iteration come from the traceback: the innermost frame of ppoflow's own code that holds
an int `iteration` and a stage name in `stage` (runtime/stage_runs.py runs every stage that way). Object
storage errors add the root URL and its endpoint. The resume command is the command that failed:
a run resumes at LATEST + 1, and inside the failed iteration at the first stage without a cached result. With
PREFECT_API_URL set (a server that outlives the command), the failed flow run's page, to Retry it from the UI.
"""

from __future__ import annotations

import os
import shlex
import sys
import traceback
from types import TracebackType
from typing import Optional

from ppoflow.config import PPOFlowConfig

_STAGES = ("rollout", "score", "update", "checkpoint", "eval")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MAX_MESSAGE_LINES = 12


class StageError(RuntimeError):
    """A stage of an iteration failed: raised by the iteration flow from the stage's own error (its __cause__), so
    that Prefect's state message on the iteration and training runs reads "update stage of iteration 3 failed:
    RewardError: ..." (Prefect writes `<type>: <str>` of the exception a flow raised, nothing of its cause)."""

    def __init__(self, stage: str, iteration: int, cause: BaseException):
        self.stage, self.iteration = stage, iteration
        first = (str(cause).strip() or "(no message)").splitlines()[0]
        text = f"{type(cause).__name__}: {first}"
        # A stage on a work pool failed in its own flow run (runtime/stage_runs.StageFailed): its error, then where.
        if own := getattr(cause, "stage_error", None):
            text = f"{own} ({getattr(cause, 'where', None) or 'on its work pool'})"
        super().__init__(f"{stage} stage of iteration {iteration} failed: {text}")

    def __reduce__(self):  # picklable without its cause (Prefect may pickle a failed state's exception)
        return (_stage_error, (self.stage, self.iteration, str(self)))


def _stage_error(stage: str, iteration: int, text: str) -> StageError:
    error = StageError.__new__(StageError)
    error.stage, error.iteration = stage, iteration
    RuntimeError.__init__(error, text)
    return error


class Terminated(KeyboardInterrupt):
    """The process was sent SIGTERM (a batch scheduler's stop, `kill`): raised in the main thread so that it
    unwinds as Ctrl-C does. Prefect marks the run, `finally` blocks and atexit hooks run (Prefect's temporary
    server is stopped by one), and the command prints the one failure message with the resume command. Without
    it Python dies at once on SIGTERM: no message, no `finally` (the server would still go: it watches its parent,
    adaptations/prefect_server.py)."""


def raise_on_sigterm():
    """Make SIGTERM raise Terminated in the main thread from now on; returns the previous handler (None off the
    main thread, where no handler can be set)."""
    import signal
    import threading

    from adaptations.prefect_sigterm import noting_sigterm

    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum, frame):
        raise Terminated("stopped by SIGTERM")

    # noted: raised inside a weakref callback it would be dropped; the next stage delivers it again
    return signal.signal(signal.SIGTERM, noting_sigterm(terminated))


def failed_stage(tb: Optional[TracebackType]) -> tuple[Optional[str], Optional[int]]:
    """(stage, iteration) from the innermost ppoflow frame that names both, else what is known, else Nones."""
    stage, iteration = None, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.startswith(_REPO):
            local_stage, local_iter = frame.f_locals.get("stage"), frame.f_locals.get("iteration")
            if isinstance(local_iter, int) and not isinstance(local_iter, bool):
                iteration = local_iter
                if local_stage in _STAGES:
                    stage = local_stage
        tb = tb.tb_next
    return stage, iteration


def _message(exc: BaseException) -> str:
    text = str(exc).strip() or "(no message)"
    lines = text.splitlines()
    if len(lines) > _MAX_MESSAGE_LINES:
        lines = lines[:_MAX_MESSAGE_LINES] + [f"... ({len(lines) - _MAX_MESSAGE_LINES} more lines in the log file)"]
    message = f"{type(exc).__name__}: " + "\n  ".join(lines)
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        message += f"\n  caused by {type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
    return message


def resume_command(argv: Optional[list[str]] = None) -> str:
    """The command line that failed, without --verbose: running it again resumes the run."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--verbose"]
    return shlex.join(["ppoflow", *args])


def describe_failure(
    exc: BaseException, cfg: Optional[PPOFlowConfig], log_path: Optional[str], argv: Optional[list[str]] = None
) -> str:
    """The message block printed on the terminal (see the module docstring); no traceback."""
    stage, iteration = failed_stage(exc.__traceback__)
    retry = retry_line(getattr(exc, "ppoflow_flow_run", None))
    if isinstance(exc, StageError) and exc.__cause__ is not None:  # the stage's own error, its place known
        stage, iteration, exc = exc.stage, exc.iteration, exc.__cause__
    lines = [f"ppoflow: error: {_message(exc)}"]
    if cfg is not None:
        where = [f"stage {stage}"] if stage else []
        if iteration is not None:
            where.append(f"iteration {iteration}")
        where.append(f"run {cfg.run.name} at {str(cfg.run.root).rstrip('/')}/{cfg.run.name}")
        lines.append("  where:   " + ", ".join(where))
        if "://" in str(cfg.run.root) and not str(cfg.run.root).startswith("file://"):
            endpoint = cfg.storage.endpoint_url or "AWS default endpoint"
            lines.append(f"  storage: {cfg.run.root} (endpoint {endpoint})")
    if log_path:
        lines.append(f"  log:     {log_path} (the traceback; --verbose shows it here)")
    lines.append(f"  resume:  {resume_command(argv)}")
    if retry:
        lines.append(f"  retry:   {retry}")
    return "\n".join(lines)


def retry_line(flow_run: Optional[dict]) -> Optional[str]:
    """How to retry the failed flow run from Prefect (UI Retry, or the CLI), when the server outlives this process
    (PREFECT_API_URL is set: the temporary server of a run without it stops with the command); None otherwise.
    `flow_run`: {"name", "id"} of the run of the ppoflow-train deployment (flows/deployment.py)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if not flow_run or not settings.api.url:
        return None
    page = f"{settings.ui_url}/runs/flow-run/{flow_run['id']}" if settings.ui_url else f"flow run {flow_run['name']}"
    return (
        f"{page} (Retry in the Prefect UI, or `prefect flow-run retry {flow_run['id']}`), with `ppoflow serve` "
        f"running: it resumes at the stage that failed"
    )


def log_traceback(exc: BaseException) -> None:
    """The full traceback to stderr: the run's log file (and the terminal too under --verbose)."""
    print("ppoflow: the command failed:", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()
