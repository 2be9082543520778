"""What rank 0, a node's rank agent and a rank process share: the rendezvous store, a rank's environment and
process, how a rank's end is described. engines/trainer/rank_group.py (rank 0), rank_agent.py (another node's
agent) and rank_link.py (a rank) use it; see rank_group.py's docstring for the protocol.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from pathlib import Path

POLL_S = 0.02  # how often a waiting side checks the store
BEAT_S = 1.0  # an agent's heartbeat period
LOG_TAIL_LINES = 15  # of a dead rank's log, quoted in the error that names it


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by signal {name} ({-code})"
    return f"exited with code {code}"


def log_tail(path: Path) -> str:
    """The last LOG_TAIL_LINES lines of a rank's log ("" when it has none)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]) if path.is_file() else ""


def connect(addr: str, port: int, timeout_s: float):
    """A client of the rendezvous store at addr:port (waits up to `timeout_s` for it to listen)."""
    import torch.distributed as dist

    return dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=timeout_s))


def group_store(base, group_id: str):
    """Group `group_id`'s key space in the rendezvous store."""
    import torch.distributed as dist

    return dist.PrefixStore(f"group/{group_id}", base)


def serve_store(port: int, timeout_s: float):
    """A rendezvous store served by this process on `port` (0: a free port the OS picks)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return dist.TCPStore("0.0.0.0", port, None, True, timeout, wait_for_workers=False)
    except RuntimeError as e:
        raise RuntimeError(f"cannot serve the update group's rendezvous on port {port} (train.master_port): {e}")


def rank_env(
    rank: int, local_rank: int, world: int, addr: str, port: int, group_id: str, timeout_s: float, parent: int
) -> dict[str, str]:
    """The environment of a rank process: a launcher's variables plus the group's id and the parent to watch."""
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding engines/, for `python -m`
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        PPOFLOW_RANK_GROUP=group_id,
        PPOFLOW_RANK_TIMEOUT_S=str(timeout_s),
        PPOFLOW_RANK_PARENT=str(parent),
        PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p),
    )
    return env


def spawn_rank(env: dict[str, str], entry: str, log_path: Path) -> subprocess.Popen:
    """Start `python -m entry` with `env`, its stdout and stderr going to `log_path`."""
    log = open(log_path, "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", entry], env=env, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()
