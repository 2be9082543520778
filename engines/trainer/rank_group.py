"""A group of data-parallel ranks that stays up between update stages.

This process is rank 0. The other ranks of its node are child processes (`python -m <entry module>`) started
once, at the first update, and kept until the process ends, a rank dies, or another placement is asked for;
then they are torn down and a new group is started. Between iterations they wait for a command:

    group = rank_group.group_for(placement, entry, timeout_s, liveness)  the running group, or a new one
                                        (RankDiedError naming a rank that died since the last stage)
    group.send({"op": ...})             one small JSON command to every rank
    rank_group.failed(exc)              after an exception: the error to raise; the group is torn down
    rank_group.shutdown()               stop the ranks (also at interpreter exit)

    rank_link.run_rank(handle)          in a rank process (engines/trainer/rank_link.py): join, then follow

Launcher: torchrun and DeepSpeed's `deepspeed` launcher both start EVERY rank as their own children and own
their lifetime (they end when the script ends). Here rank 0 must be the process that already runs the stage
(the in-process pipeline, or a warm `ppoflow worker --stage update`), and the group must outlive one stage,
so neither fits. The group uses the same contract they use instead: torch.distributed's rendezvous over a
c10d TCPStore that rank 0 hosts (the env variables RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
are set as a launcher sets them) and DeepSpeed adopting that process group
(deepspeed_setup.join_process_group). Each group has its own key space in the store, `group/<id>/`.

Several nodes (engines/trainer/hostfile.py): the store listens on train.master_port for the whole life of
this process, and on every other node a rank agent (engines/trainer/rank_agent.py, `ppoflow rank-agent`)
stays connected to it. Rank 0 publishes each new group under the key `group`; the agent of node k starts
that node's ranks, writes `exit/<rank>` (exit code, log tail) when one of them ends, and adds 1 to `beat/<k>`
every second. A node whose heartbeat stops for train.rank_heartbeat_lost_s is reported dead, naming its ranks.

Commands travel through the store (key cmd/<n>), not through a collective: a rank may wait for the
next iteration far longer than any collective timeout (rollout and scoring run in between). They are JSON
(no pickle), a few hundred bytes: references to storage, never tensors. A rank that fails a command writes
its error to the store (err/<rank>) and exits 1; rank 0 then names it. Ranks end with rank 0: while
waiting for a command they check their parent pid (rank 0, or their node's agent) and the store, and in a
collective gloo/NCCL fail when its sockets close.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from engines.trainer.deepspeed_setup import leave_process_group
from engines.trainer.hostfile import Placement
from engines.trainer.rank_wire import (
    BEAT_S,
    POLL_S,
    connect,
    describe_exit,
    group_store,
    log_tail,
    rank_env,
    serve_store,
    spawn_rank,
)

_BOOT_S = 300.0  # ranks 1..N-1 importing torch / DeepSpeed / transformers on a busy machine
_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankDiedError(RuntimeError):
    """A rank of the update's group exited; the message names it, its exit code or signal, and its last words."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class Liveness:
    """How long rank 0 waits on another node's agent, from the config (train.rank_agent_join_s,
    train.rank_heartbeat_lost_s, whose defaults live there): a node whose agent has not beaten yet gets `join_s`
    from the group's start (the agent polls for it each 1 s); one that has beaten and then stops for `lost_s` is
    dead (lost_s / BEAT_S missed beats)."""

    join_s: float
    lost_s: float


_rendezvous: dict[int, Any] = {}  # port -> the store this process serves there for all its multi-node groups


def _shared_rendezvous(port: int, timeout_s: float):
    """The store on `port` that the other nodes' agents stay connected to, for as long as this process lives."""
    if port not in _rendezvous:
        _rendezvous[port] = serve_store(port, timeout_s)
    return _rendezvous[port]


class _Heartbeats:
    """Watches the `beat/<node>` counters of the other nodes' agents from a thread with its own store client."""

    def __init__(self, placement: Placement, timeout_s: float):
        self.nodes = range(1, len(placement.nodes))
        self._store = connect(placement.master_addr, placement.master_port, timeout_s)
        # the counts persist in the store from earlier groups (a dead agent's last count too): only a change
        # from here on is a beat
        self._initial = {node: self._store.add(f"beat/{node}", 0) for node in self.nodes}
        now = time.monotonic()
        self._seen = {node: (count, now) for node, count in self._initial.items()}  # (last count, when it changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rank-heartbeats", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S / 2):
            for node in self.nodes:
                try:
                    count = self._store.add(f"beat/{node}", 0)
                except RuntimeError:
                    return
                if count != self._seen[node][0]:
                    self._seen[node] = (count, time.monotonic())

    def silence(self, node: int) -> tuple[bool, float]:
        """(whether node's agent has beaten since this group started, seconds since its count last changed)."""
        count, when = self._seen[node]
        return count != self._initial[node], time.monotonic() - when

    def stop(self) -> None:
        self._stop.set()


class RankGroup:
    """Ranks 1..world-1 (this node's as child processes, other nodes' through their agents) and this process
    as rank 0 of one torch.distributed group."""

    def __init__(self, placement: Placement, entry: str, timeout_s: float, liveness: Liveness):
        import torch

        local = placement.nodes[0].slots
        if torch.cuda.is_available() and torch.cuda.device_count() < local:
            raise ValueError(
                f"{local} update ranks on this machine need one GPU each, but it has {torch.cuda.device_count()} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        self.placement = placement
        self.world = placement.world
        self.timeout_s = timeout_s
        self.liveness = liveness
        self.id = f"{os.getpid()}-{secrets.token_hex(4)}"
        if placement.remote:
            base = _shared_rendezvous(placement.master_port, timeout_s)
        else:
            base = serve_store(0, timeout_s)  # port 0: the OS picks a free port, no race with others
        self.port = base.port
        self.addr = placement.master_addr
        self.store = group_store(base, self.id)
        self.log_dir = Path(tempfile.mkdtemp(prefix="ppoflow-ranks-"))
        self.holds: Optional[str] = None  # identity of the weights every rank's trainer holds (set by the stage)
        self._sent = 0
        self._saved_env = {key: os.environ.get(key) for key in _ENV_KEYS}
        self.procs: dict[int, subprocess.Popen] = {}
        self.heartbeats: Optional[_Heartbeats] = None
        if placement.remote:  # before this node's ranks: a failure here leaves no process behind
            self.heartbeats = _Heartbeats(placement, timeout_s)
            spec = {"id": self.id, "entry": entry, "timeout_s": timeout_s, "world": self.world}
            spec.update(master_addr=self.addr, master_port=self.port)
            spec["nodes"] = [{"host": n.host, "slots": n.slots} for n in placement.nodes]
            base.set("group", json.dumps(spec))  # the agents start their ranks when they see a new id
        for rank in range(1, local):
            self.procs[rank] = self._spawn(rank, entry)

    def _spawn(self, rank: int, entry: str) -> subprocess.Popen:
        env = rank_env(rank, rank, self.world, self.addr, self.port, self.id, self.timeout_s, parent=os.getpid())
        return spawn_rank(env, entry, self.log_dir / f"rank{rank}.log")

    @property
    def remote_ranks(self) -> range:
        return range(self.placement.nodes[0].slots, self.world)

    @property
    def pids(self) -> dict[int, int]:
        """{rank: pid} of ranks 1..N-1 (rank 0 is this process; another node's pid is on that node)."""
        pids = {rank: proc.pid for rank, proc in self.procs.items()}
        for rank in self.remote_ranks:
            if self.store.check([f"booted/{rank}"]):
                pids[rank] = int(self.store.get(f"booted/{rank}"))
        return pids

    def join(self) -> None:
        """Wait until every rank has started (naming one that died first), then join the process group."""
        from engines.trainer.deepspeed_setup import join_process_group

        limit = min(_BOOT_S, self.timeout_s)
        deadline = time.monotonic() + limit
        waiting = set(range(1, self.world))
        while waiting:
            self.check_alive()
            waiting = {r for r in waiting if not self.store.check([f"booted/{r}"])}
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"update ranks {sorted(waiting)} did not start within {limit:.0f} s ({self._where()})"
                )
            time.sleep(POLL_S)
        join_process_group(
            self.store, 0, self.world, self.timeout_s, local_rank=0, master_addr=self.addr, master_port=self.port
        )

    def _where(self) -> str:
        if not self.placement.remote:
            return f"logs in {self.log_dir}"
        return f"this node's logs in {self.log_dir}; other nodes' in their agent's output"

    def _agent_hint(self, node: int) -> str:
        return f"`ppoflow rank-agent --master {self.addr}:{self.port} --node {node}`"

    def check_alive(self) -> None:
        """RankDiedError naming the first rank that has exited (its exit code or signal, its last log lines),
        or the first other node whose agent fell silent."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise RankDiedError(self._death_message(rank, code), rank)
        if self.placement.remote and self.store.check(["refused"]):
            refusal = self.store.get("refused").decode(errors="replace")
            raise RankDiedError(f"a rank agent refused the group: {refusal}", self.placement.first_rank(1))
        for rank in self.remote_ranks:
            if self.store.check([f"exit/{rank}"]):
                raise RankDiedError(self._remote_death_message(rank), rank)
        if self.heartbeats is not None:
            for node in self.heartbeats.nodes:
                beaten, silent_s = self.heartbeats.silence(node)
                if silent_s > (self.liveness.lost_s if beaten else self.liveness.join_s):
                    raise RankDiedError(self._silence_message(node, beaten, silent_s), self.placement.first_rank(node))

    def _reported(self, rank: int) -> str:
        try:
            if self.store.check([f"err/{rank}"]):
                return ": " + self.store.get(f"err/{rank}").decode(errors="replace")
        except RuntimeError:
            pass
        return ""

    def _death_message(self, rank: int, code: int) -> str:
        log_path = self.log_dir / f"rank{rank}.log"
        tail = log_tail(log_path)
        return (
            f"update rank {rank} of {self.world} (pid {self.procs[rank].pid}) {describe_exit(code)}"
            f"{self._reported(rank)}\nlast lines of {log_path}:\n{tail}"
        )

    def _remote_death_message(self, rank: int) -> str:
        info = json.loads(self.store.get(f"exit/{rank}"))
        node = self.placement.node_of(rank)
        return (
            f"update rank {rank} of {self.world} on node {node} ({info['host']}, pid {info['pid']}) "
            f"{describe_exit(int(info['code']))}{self._reported(rank)}\n"
            f"last lines of {info['log']} on {info['host']}:\n{info['tail']}"
        )

    def _silence_message(self, node: int, beaten: bool, silent_s: float) -> str:
        ranks = self.placement.ranks_of(node)
        host = self.placement.nodes[node].host
        head = f"update ranks {ranks.start}..{ranks.stop - 1} of {self.world} on node {node} ({host}): "
        if not beaten:
            return head + (
                f"no rank agent of that node joined the rendezvous at {self.addr}:{self.port} within {silent_s:.0f} "
                f"s; run {self._agent_hint(node)} on {host}"
            )
        return head + (
            f"its rank agent sent no heartbeat for {silent_s:.0f} s (the node, its network or the agent died)"
        )

    def send(self, command: dict[str, Any]) -> None:
        """Hand `command` (JSON-able) to ranks 1..N-1; RankDiedError first if one of them has exited."""
        self.check_alive()
        self.store.set(f"cmd/{self._sent}", json.dumps(command))
        self._sent += 1

    def dead_rank(self, grace_s: float) -> Optional[RankDiedError]:
        """The error naming a rank that has exited, waiting up to `grace_s` for one (after a failed collective,
        the rank that broke it may still be on its way out; with other nodes, up to a lost heartbeat's time
        for a node that died whole); None when all live."""
        if self.heartbeats is not None:
            grace_s = max(grace_s, self.liveness.lost_s + 2 * BEAT_S)
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self.check_alive()
            except RankDiedError as died:
                return died
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def close(self, graceful: bool) -> None:
        """Stop ranks 1..N-1 (a stop command first when `graceful`, else SIGKILL here and an abort for the
        other nodes' agents), then leave the process group."""
        alive = all(p.poll() is None for p in self.procs.values())
        try:
            self.store.set(f"cmd/{self._sent}" if graceful and alive else "abort", json.dumps({"op": "stop"}))
        except RuntimeError:
            pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10 if graceful else 0.01)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.heartbeats is not None:
            self.heartbeats.stop()
        leave_process_group()
        if graceful:  # after a failure the logs stay: the error message points at them
            shutil.rmtree(self.log_dir, ignore_errors=True)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_group: Optional[RankGroup] = None
_starts = 0  # groups this process has started (each start spawns world - 1 processes)


def group_starts() -> int:
    """How many rank groups this process has started: 1 for as long as the first one stays up."""
    return _starts


def current() -> Optional[RankGroup]:
    return _group


def group_for(placement: Placement, entry: str, timeout_s: float, liveness: Liveness) -> RankGroup:
    """The running group with `placement`, else a new one (an old group placed otherwise is stopped first).

    A group with a rank that died since the last stage is torn down and RankDiedError names the rank: the stage
    fails, and its retry starts a new group (whose trainers are built from the committed checkpoint).
    A new group drops this process's warm trainer: its DeepSpeed engines belong to the old process group.
    """
    global _group, _starts
    if _group is not None:
        if _group.placement == placement:
            try:
                _group.check_alive()
                return _group
            except RankDiedError:
                shutdown(graceful=False)
                raise
        shutdown()
    from engines import warm

    warm.invalidate(warm.Role.TRAINER)
    leave_process_group()  # a one-rank world of this process (a trainer with num_ranks=1 ran before)
    group = RankGroup(placement, entry, timeout_s, liveness)
    _starts += 1
    try:
        group.join()
    except BaseException:
        group.close(graceful=False)
        raise
    _group = group
    return group


def failed(exc: BaseException) -> BaseException:
    """The error a stage raises after `exc` interrupted a command to the group; the group is torn down (its
    ranks may be anywhere in a collective, and their trainers' weights have moved past the checkpoint).

    A communication error with a rank dead becomes RankDiedError naming that rank (chained to `exc`); any
    other exception (the same ValueError raised on every rank, say) is returned as it is.
    """
    group = _group
    if group is None or isinstance(exc, RankDiedError):
        shutdown(graceful=False)
        return exc
    died = group.dead_rank(grace_s=5.0) if isinstance(exc, RuntimeError) else None
    shutdown(graceful=False)
    if died is not None:
        died.__cause__ = exc
        return died
    return exc


def shutdown(graceful: bool = True) -> None:
    """Stop the running group, if any; this process's warm trainer (of that group) is dropped too."""
    global _group
    group, _group = _group, None
    if group is None:
        return
    from engines import warm

    warm.invalidate(warm.Role.TRAINER)
    group.close(graceful)


atexit.register(shutdown)
