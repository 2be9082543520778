"""A node's rank agent: starts this node's update ranks for every group rank 0 publishes (`ppoflow rank-agent`).

Run once per node other than rank 0's, by whatever keeps services up there (systemd, a Slurm step, a pod):

    ppoflow rank-agent --master node-a:29500 --node 1

It connects to the rendezvous store rank 0 serves (engines/trainer/rank_group.py) and stays: waiting while no
training process serves it, reconnecting after rank 0's process ends, so a run resumed or retried from the
Prefect UI (a new process) finds it. Per group it

- starts the node's ranks (hostfile line `--node`: ranks first..first+slots-1, local ranks 0..slots-1) with the
  environment a launcher sets, their output in a log file per rank;
- writes `exit/<rank>` (exit code, pid, host, log path and its last lines) when one of them ends, which rank 0
  turns into the RankDiedError naming the rank;
- kills them when rank 0 aborts the group, publishes a new one, or goes away;
- adds 1 to `beat/<node>` every second, from which rank 0 tells a dead node from a slow one.

Why an agent and not DeepSpeed's launcher (pdsh/ssh): the launcher starts the ranks for one script run and
ends them with it; the update group outlives stages and is rebuilt from the committed checkpoint after a
failure, which needs someone on the node to start ranks again, without an ssh hop per rebuild.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from engines.trainer.rank_wire import BEAT_S, connect, group_store, log_tail, rank_env, spawn_rank

log = logging.getLogger("ppoflow.rank_agent")

_POLL_S = 0.05
_CONNECT_S = 30.0  # one connection attempt waits this long for rank 0's store to listen


class _NodeRanks:
    """This node's rank processes of one group, and which of their exits were reported."""

    def __init__(self, spec: dict, node: int, base):
        nodes = spec["nodes"]
        if not 0 < node < len(nodes):
            refusal = (
                f"this agent is node {node}, but the group published by rank 0 has nodes 0..{len(nodes) - 1} "
                f"(train.hostfile: {', '.join(n['host'] for n in nodes)}); node 0 is rank 0's own"
            )
            group_store(base, spec["id"]).set("refused", refusal)  # rank 0 names it instead of waiting
            raise ValueError(refusal)
        self.id = spec["id"]
        self.store = group_store(base, self.id)
        self.log_dir = Path(tempfile.mkdtemp(prefix="ppoflow-ranks-"))
        first = sum(n["slots"] for n in nodes[:node])
        self.procs: dict[int, subprocess.Popen] = {}
        for local in range(nodes[node]["slots"]):
            rank = first + local
            env = rank_env(
                rank,
                local,
                spec["world"],
                spec["master_addr"],
                spec["master_port"],
                self.id,
                spec["timeout_s"],
                parent=os.getpid(),
            )
            self.procs[rank] = spawn_rank(env, spec["entry"], self.log_dir / f"rank{rank}.log")
        self.reported: set[int] = set()
        log.info("group %s: started ranks %s (logs in %s)", self.id, sorted(self.procs), self.log_dir)

    def report_exits(self) -> None:
        """Write `exit/<rank>` for every rank that ended since the last call."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is None or rank in self.reported:
                continue
            path = self.log_dir / f"rank{rank}.log"
            info = {
                "code": code,
                "pid": proc.pid,
                "host": socket.gethostname(),
                "log": str(path),
                "tail": log_tail(path),
            }
            self.store.set(f"exit/{rank}", json.dumps(info))
            self.reported.add(rank)
            level = logging.INFO if code == 0 else logging.WARNING
            log.log(level, "group %s: rank %d (pid %d) ended with code %d", self.id, rank, proc.pid, code)
        clean = len(self.reported) == len(self.procs) and all(p.returncode == 0 for p in self.procs.values())
        if clean and self.log_dir.is_dir():
            shutil.rmtree(self.log_dir, ignore_errors=True)  # a clean stop; after a failure the logs stay

    def aborted(self) -> bool:
        return self.store.check(["abort"])

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _follow(base, node: int) -> None:
    """Serve the groups of one rank-0 process until its store goes away (RuntimeError from the store)."""
    ranks: Optional[_NodeRanks] = None
    next_beat = 0.0
    try:
        while True:
            now = time.monotonic()
            if now >= next_beat:
                base.add(f"beat/{node}", 1)
                next_beat = now + BEAT_S
            if base.check(["group"]):
                spec = json.loads(base.get("group"))
                if ranks is None or spec["id"] != ranks.id:
                    if ranks is not None:
                        ranks.kill()
                    ranks = None
                    ranks = _NodeRanks(spec, node, base)
            if ranks is not None:
                ranks.report_exits()
                if ranks.aborted():
                    ranks.kill()
                    ranks.report_exits()
            time.sleep(_POLL_S)
    finally:
        if ranks is not None:
            ranks.kill()


def serve(master: str, node: int) -> None:
    """Run the agent of node `node` for the rendezvous at `master` ("host:port") until interrupted."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--master {master!r} is not host:port (train.master_addr:train.master_port)")
    if node < 1:
        raise ValueError(f"--node {node}: node 0 is rank 0's own machine; agents serve nodes 1 and up")
    waiting_logged = False
    while True:
        try:
            # A plain TCP probe first: the store's client, when nothing listens, waits out its timeout and
            # logs a C++ stack trace per attempt, which an agent idle between runs would print all day.
            socket.create_connection((host, int(port)), timeout=5.0).close()
            base = connect(host, int(port), _CONNECT_S)
        except (OSError, RuntimeError):  # nothing listens yet (no run), or the address is wrong: say so once
            if not waiting_logged:
                log.info("node %d: waiting for rank 0's rendezvous at %s", node, master)
                waiting_logged = True
            time.sleep(1.0)
            continue
        log.info("node %d: connected to %s", node, master)
        waiting_logged = False
        try:
            _follow(base, node)
        except RuntimeError as e:  # the store closed: rank 0's process ended
            log.info("node %d: rank 0's rendezvous at %s went away (%s); waiting for the next one", node, master, e)
        except ValueError as e:  # a group this node has no place in
            log.error("%s", e)
            time.sleep(5.0)
