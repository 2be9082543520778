"""The update group that a training flow starts itself: train.num_ranks > 1 with the update on no worker or pool.

Several update ranks are always a torchrun group that is the warm update worker (engines/trainer/torchrun_group.py).
A run that asks for train.num_ranks = N > 1 and sends its update to neither a warm worker (pipeline.stage_workers)
nor a pool (pipeline.stage_pools) gets one on this machine, started by its training flow (flows/training.py):

    python -m torch.distributed.run --standalone --nproc-per-node=N --max-restarts=R --local-addr=127.0.0.1 \
        -m cli worker --stage update --stage checkpoint

    with owned_update_group(cfg):      started at the flow's start (it boots while rollout and scoring run), and
        ...                            stopped when the flow ends, fails or is interrupted (SIGTERM, Ctrl-C)
    running()                          the group this process owns now, if any: runtime/stage_runs.py sends the update
                                       and checkpoint stages to it (placement "group") and waits for it to serve

Why torchrun as a child process and not torch's `elastic_launch` in this process: the agent installs signal handlers
and blocks while the group runs, and the flow needs its thread; a child is also what a user starts by hand, so both
paths run the same code. The group finds the flow's Prefect server through PREFECT_API_URL: the one this process
reports to, or, without one, the temporary server Prefect started for this process (on a port of its choosing, which
no setting names: it is passed on). Its code is this process's: the folder holding `flows/` goes first on its
PYTHONPATH.

Failure: torchrun's agent restarts every rank when one dies (R = pipeline.retries + 1: one restart for each retry of
a stage, and one for a rank lost between stages). The stage that was running fails with the group's error, or with
StageFailed when rank 0 is gone (its lease); runtime/stage_runs.py then retries it up to pipeline.retries times on the
restarted group, whose trainers are built from the committed checkpoint, so the run ends as one that never failed.
A group that exits (restarts used up, a rank that cannot start) or does not serve within READY_S fails the stage
with UpdateGroupFailed, naming its log. Its output, the agent's and the ranks', goes to
`<run>/logs/update-group-<UTC time>.log` (on object storage: the run's local log folder, flows/logs.py), not to the
terminal. If this process is SIGKILLed, the agent gets SIGTERM from the kernel (Linux: PR_SET_PDEATHSIG) and stops
its ranks.

Limits: the group serves the update task of its Prefect server, not of this run alone. Another run on the same
server whose update goes to warm workers or to a group of its own may be served by it (its trainers are then built
from that run's checkpoint; a run with another train.num_ranks is refused by name), and this run's by theirs. One
node: several nodes are a torchrun per node that the user starts (README, "Several update ranks with torchrun").
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from ppoflow.config import PPOFlowConfig
from storage.run_logs import log_dir_for

READY_S = 600.0  # N processes importing torch, DeepSpeed and Prefect, then connecting, on a loaded machine
STOP_S = 45.0  # SIGTERM -> the agent stops its ranks (torchrun waits 30 s for them before SIGKILL)
_POLL_S = 0.5
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PR_SET_PDEATHSIG = 1


class UpdateGroupFailed(RuntimeError):
    """The update group this flow started exited, or did not serve within READY_S; names its log."""


class OwnedUpdateGroup:
    """The torchrun agent this process started (`agent`), its log, and the run's number of ranks."""

    def __init__(self, agent: subprocess.Popen, log_path: str, ranks: int):
        self.agent, self.log_path, self.ranks = agent, log_path, ranks

    def wait_ready(self, timeout_s: float = READY_S) -> None:
        """Return once the Prefect server lists rank 0 of this group as serving the update stage (or cannot say).

        Raises UpdateGroupFailed, with the tail of the group's log, when the agent has exited or none serves within
        `timeout_s` (a restarted group counts from the call)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.agent.poll() is not None:
                raise UpdateGroupFailed(f"{self._what()} exited with code {self.agent.returncode}{self._tail()}")
            if self._serving():
                return
            if time.monotonic() > deadline:
                raise UpdateGroupFailed(
                    f"{self._what()} did not serve the update stage within {timeout_s:.0f} s{self._tail()}"
                )
            time.sleep(_POLL_S)

    def _serving(self) -> bool:
        """Every rank runs and rank 0 is listed. A rank short: a rank died and torchrun is stopping the others (its
        monitor looks every 0.1 s) before it starts them all again; the old rank 0 may still be listed meanwhile."""
        from tasks.leases import serving_workers
        from tasks.stage_tasks import STAGE_TASKS

        pids = self._rank_pids()
        if len(pids) < self.ranks:
            return False
        listed = serving_workers(STAGE_TASKS["update"].task_key)
        if listed is None:  # the server cannot say: the stage's own watch decides (runtime/stage_runs.py)
            return True
        return bool({f"{socket.gethostname()}:{pid}" for pid in pids} & set(listed))

    def _rank_pids(self) -> list[int]:
        """The agent's children that run (its ranks; one that died and was not reaped yet is a zombie)."""
        import psutil

        try:
            children = psutil.Process(self.agent.pid).children()
        except psutil.NoSuchProcess:
            return []
        running = []
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    running.append(child.pid)
            except psutil.NoSuchProcess:
                pass
        return running

    def stop(self) -> None:
        """SIGTERM to the agent, which stops its ranks (each in a session of its own, so not by process group);
        SIGKILL to the agent after STOP_S, and to any rank it left behind."""
        import psutil

        try:
            ranks = psutil.Process(self.agent.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            ranks = []
        if self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
        _, left = psutil.wait_procs(ranks, timeout=5)
        for rank in left:
            try:
                rank.kill()
            except psutil.NoSuchProcess:
                pass

    def _what(self) -> str:
        return f"the update group (torchrun, {self.ranks} ranks, pid {self.agent.pid}) that this run started"

    def _tail(self, lines: int = 30) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"; its log {self.log_path} cannot be read"
        return f"; the end of its log {self.log_path}:\n" + "\n".join(text)


def starts_update_group(cfg: PPOFlowConfig) -> bool:
    """Whether the training flow of `cfg` starts its own update group: train.num_ranks > 1 and the update sent to
    neither a warm worker nor a pool (runtime/placement.placement sends update and checkpoint to it then)."""
    on_pool = bool((cfg.pipeline.stage_pools or {}).get("update"))
    return cfg.train.num_ranks > 1 and "update" not in cfg.pipeline.stage_workers and not on_pool


_running: Optional[OwnedUpdateGroup] = None


def running() -> Optional[OwnedUpdateGroup]:
    """The update group this process started and has not stopped yet, if any."""
    return _running


@contextmanager
def owned_update_group(cfg: PPOFlowConfig) -> Iterator[Optional[OwnedUpdateGroup]]:
    """The update group of `cfg` for the duration of the block when `starts_update_group(cfg)`, else None (see the
    module docstring). Returns without waiting for it to serve: the first update waits (OwnedUpdateGroup.wait_ready).
    RuntimeError when this process already owns one (two training flows in one process at once)."""
    global _running
    if not starts_update_group(cfg):
        yield None
        return
    if _running is not None:
        raise RuntimeError(f"this process already runs an update group ({_running._what()})")
    group = _start(cfg)
    _running = group
    try:
        yield group
    finally:
        _running = None
        group.stop()


def _start(cfg: PPOFlowConfig) -> OwnedUpdateGroup:
    log_dir = log_dir_for(cfg)[0]
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"update-group-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.log")
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.train.num_ranks}",
        f"--max-restarts={cfg.pipeline.retries + 1}",
        "--local-addr=127.0.0.1",
        "-m",
        "cli",
        *("worker", "--stage", "update", "--stage", "checkpoint"),
    ]
    with open(log_path, "ab") as log:
        agent = subprocess.Popen(
            argv,
            env=_group_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C on the terminal reaches this process, which stops the group in order
            preexec_fn=_die_with_parent(),
        )
    return OwnedUpdateGroup(agent, log_path, cfg.train.num_ranks)


def _group_env() -> dict[str, str]:
    """This process's environment for the group: PREFECT_API_URL set to the server this process reports to, this
    checkout first on PYTHONPATH, and no launcher variables of this process's own one-rank trainer (torchrun sets
    each rank's)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.pop("PREFECT__FLOW_RUN_ID", None)  # the group serves task runs; it runs no flow run of its own
    env["PREFECT_API_URL"] = _api_url()
    root = str(Path(__file__).resolve().parents[1])  # the folder holding flows/, engines/, ...
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _api_url() -> str:
    """The Prefect API this process reports to; without PREFECT_API_URL, Prefect's temporary server (started here
    by the flow run already: SubprocessASGIServer is one per process)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return server.api_url


def _die_with_parent():
    """A preexec_fn that asks the kernel to SIGTERM the child when the thread that started it ends (Linux; None
    elsewhere). The flow's thread outlives the group unless this process is killed outright."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child runs only the call itself before exec

    def set_death_signal() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return set_death_signal
