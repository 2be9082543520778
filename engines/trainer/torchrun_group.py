"""The warm update worker as a torchrun-launched group of data-parallel ranks.

    torchrun --nproc-per-node=2 --no-python ppoflow worker --stage update --stage checkpoint

starts two processes, each given RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and the rendezvous
store by torchrun. `ppoflow worker` (runtime/workers.py) sees that torchrun launched it (`launched()`), joins the
process group (`join()`), and then:
- rank 0 (`current()`) registers with Prefect as any `ppoflow worker --stage update` does and takes the update and
  checkpoint task runs; its update stage (stages/update_ranks.py) drives the other ranks with `send`;
- ranks 1..N-1 never talk to Prefect: they `follow` rank 0's commands until it stops them.

Commands are small JSON documents (references to storage, never tensors) set under `cmd/<n>` in the group's store,
not sent through a collective: a follower waits between iterations (rollout and scoring run meanwhile) far longer
than any collective timeout. The store (and the process group's rendezvous) is one that rank 0 hosts for this start
of the group, found through torchrun's store: `_group_store` says why not torchrun's store itself.

Failure: torchrun owns the group's life. A rank that ends (SIGKILL, OOM, or an error in a command, which a follower
leaves in `err/<rank>` before it exits 1) makes torchrun stop every rank of the group, rank 0 too, and start them
all again (--max-restarts); on several nodes the other nodes' agents restart theirs at the next rendezvous round.
Rank 0's death drops its stage lease (tasks/leases.py), so the flow fails the stage naming the worker; the retried
flow run goes to the restarted group, whose trainers are built from the committed checkpoint. A command that fails
on rank 0 (the followers may be inside a collective, their weights past the checkpoint) breaks the group: the
stage fails with that error, then rank 0 ends its process (runtime/workers.py) and torchrun restarts the group.

Why every rank must be restarted together: DeepSpeed's ZeRO-3 numbers the parameters and modules it partitions from
process-wide counters and checks that every rank traces the same numbers. Every rank of a (re)started group is a new
process counting from 0, and every trainer is built on every rank, so the counters move in lockstep; a rank 0 that
outlived ranks started again would not.

Who starts the group: the user (one torchrun per node, or Slurm, a Kubernetes PyTorchJob, a work pool's job), or
`ppoflow train` itself on its own machine when a run asks for several ranks and sends the update to no worker or pool
(runtime/update_group.py).
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import secrets
import socket
import sys
import time
import traceback
from typing import Any, Callable, Iterator, NoReturn, Optional

POLL_S = 0.02  # how often a follower checks the store for the next command
STORE_TIMEOUT_S = 300.0  # for the ranks to reach the stores on a busy machine
CONNECT_S = 5.0  # to connect to a published store: one that does not answer by then has ended with its group
COLLECTIVE_TIMEOUT_S = 1800.0  # one collective (torch's default); a dead rank ends the group long before
LEADER_KEY = "ppoflow/update-group/leader"  # in the agent's store: where rank 0 of the latest start serves its store
_KEY_SPACE = "update-group"
_NEXT = (
    ". A rank that died is named in its torchrun agent's output. Rank 0 ends and torchrun restarts the whole group "
    "(--max-restarts); then retry the flow run: the stage reruns from the last committed checkpoint"
)


class TorchrunGroup:
    """This process's place in the group torchrun started: its rank, the group's size, the group's store (rank 0
    hosts it: `_group_store`). On rank 0 also what the update stage keeps between iterations (`holds`) and whether
    a failed command broke the group (`broken`)."""

    def __init__(self, rank: int, world: int, store, group_id: str):
        self.rank, self.world, self.store, self.id = rank, world, store, group_id
        self.holds: Optional[str] = None  # identity of the weights every rank's trainer holds (set by the stage)
        self.broken: Optional[str] = None  # the error that broke the group (rank 0), after which it must restart
        self._sent = 0

    # rank 0
    def require(self, num_ranks: int) -> None:
        """ValueError when a run's train.num_ranks is not this group's size (its batch is split over that many
        ranks); RuntimeError when an earlier command broke the group (it is about to be restarted)."""
        if self.broken is not None:
            raise RuntimeError(f"the torchrun update group broke ({self.broken}) and is being restarted by torchrun")
        if num_ranks != self.world:
            raise ValueError(
                f"train.num_ranks={num_ranks} but this update worker is a torchrun group of {self.world} rank(s) "
                f"(WORLD_SIZE={self.world}): set train.num_ranks={self.world}, or serve the run with a group of "
                f"{num_ranks} (torchrun --nnodes x --nproc-per-node = {num_ranks})"
            )

    def send(self, command: dict[str, Any]) -> None:
        """Hand `command` (JSON-able) to ranks 1..N-1; they run it in the order sent."""
        if self.broken is not None:
            raise RuntimeError(f"the torchrun update group broke ({self.broken}) and is being restarted by torchrun")
        self.store.set(f"cmd/{self._sent}", json.dumps(command))
        self._sent += 1

    def failed(self, exc: BaseException) -> BaseException:
        """After `exc` interrupted the group's commands: mark the group broken (rank 0 ends its process once the
        stage has failed: runtime/workers.py) and return the error to raise (the caller chains `exc`): one naming the
        followers that reported an error of their own; for a communication error (RuntimeError: a collective or
        the store broke, as when a rank dies), one saying what happens next; else `exc`."""
        self.broken = f"{type(exc).__name__}: {exc}"[:500]
        reported = self.reported_errors()
        if reported:
            ranks = "; ".join(f"rank {rank}: {text}" for rank, text in reported.items())
            return RuntimeError(f"update rank(s) of the torchrun group of {self.world} failed ({ranks}){_NEXT}")
        if isinstance(exc, RuntimeError):
            return RuntimeError(f"the torchrun update group of {self.world} ranks failed ({self.broken}){_NEXT}")
        return exc

    def reported_errors(self) -> dict[int, str]:
        """{rank: the error it left in the store} of the followers that failed a command."""
        found = {}
        for rank in range(1, self.world):
            try:
                if self.store.check([f"err/{rank}"]):
                    found[rank] = self.store.get(f"err/{rank}").decode(errors="replace")
            except RuntimeError:  # the store went away: nothing more to say
                break
        return found

    def stop(self) -> None:
        """Tell the followers to exit 0 (rank 0 ending normally: torchrun then sees the whole group succeed)."""
        if self.broken is None:
            try:
                self.send({"op": "stop"})
            except RuntimeError:
                pass

    # ranks 1..N-1
    def follow(self, handle: Callable[[dict[str, Any]], None]) -> NoReturn:
        """`handle(command)` for each of rank 0's commands, in order, until {"op": "stop"}; then exit 0. A command
        that raises leaves its error in the store (`err/<rank>`) and exits 1: torchrun restarts the group."""
        try:
            for command in self._commands():
                handle(command)
        except BaseException as exc:
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            try:
                self.store.set(f"err/{self.rank}", text[-2000:])
            except RuntimeError:
                pass
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # no atexit hook may block on a collective the others will never join
        sys.stdout.flush()
        os._exit(0)

    def _commands(self) -> Iterator[dict[str, Any]]:
        parent = os.getppid()  # torchrun's agent
        n = 0
        while True:
            key = f"cmd/{n}"
            while not self._ready(key, parent):
                time.sleep(POLL_S)
            command = json.loads(self.store.get(key))
            n += 1
            if command.get("op") == "stop":
                return
            yield command

    def _ready(self, key: str, parent: int) -> bool:
        if os.getppid() != parent:  # the agent is gone (killed): nobody will stop or restart this rank
            os._exit(3)
        try:
            return self.store.check([key])
        except RuntimeError:  # rank 0, which hosts the store, has ended: so does this rank (torchrun sees to the rest)
            os._exit(3)


def launched() -> bool:
    """Whether torchrun (its elastic agent) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


_group: Optional[TorchrunGroup] = None


def current() -> Optional[TorchrunGroup]:
    """The torchrun group this process is rank 0 of, once joined; None elsewhere (followers included)."""
    return _group


def join() -> TorchrunGroup:
    """Join the group torchrun's environment describes: the process group (gloo on CPU, NCCL on GPU, adopted by
    DeepSpeed as a trainer uses it) and the group's store (`_group_store`). Every rank calls it once, at start.

    Raises RuntimeError when torchrun did not start this process; TimeoutError when rank 0's store cannot be
    reached within STORE_TIMEOUT_S; torch's error when the process group cannot form."""
    global _group
    from engines.trainer.deepspeed_setup import join_process_group

    if not launched():
        raise RuntimeError("torchrun_group.join: this process was not started by torchrun (no TORCHELASTIC_RUN_ID)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, group_id, (addr, port) = _group_store(rank)
    local_rank = int(os.environ["LOCAL_RANK"])
    join_process_group(
        store, rank, world, COLLECTIVE_TIMEOUT_S, local_rank=local_rank, master_addr=addr, master_port=port
    )
    group = TorchrunGroup(rank, world, _prefixed(store), group_id)
    if rank == 0:
        _group = group
        atexit.register(group.stop)
    return group


def _prefixed(store):
    import torch.distributed as dist

    return dist.PrefixStore(_KEY_SPACE, store)


def _group_store(rank: int):
    """(store, group id, (addr, port)): a store that only this start of the group uses, hosted by rank 0.

    Why not torchrun's store as it is: with the c10d rendezvous the agent serves one store at MASTER_ADDR:MASTER_PORT
    for all its restarts, and torch.distributed's env:// rendezvous writes the same keys in it at every start of the
    group; a restarted rank read the dead group's gloo address there and failed to connect (seen here, torch 2.13).
    So rank 0 hosts a new store on a free port and publishes where under LEADER_KEY in the agent's store; the other
    ranks take the published address whose store answers (the old group's died with its rank 0, as torchrun stops
    every rank before starting any). Where the agent shares no store (TORCHELASTIC_USE_AGENT_STORE is not True:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), MASTER_PORT is new at every start and rank 0 hosts the store there, as
    torch.distributed's env:// rendezvous does."""
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        store = dist.TCPStore(addr, port, None, rank == 0, timeout, wait_for_workers=False)
        return store, f"{addr}:{port}", (addr, port)
    agent = dist.TCPStore(addr, port, None, False, timeout)
    if rank == 0:
        store = dist.TCPStore(addr, 0, None, True, timeout, wait_for_workers=False)
        group_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        agent.set(LEADER_KEY, json.dumps({"addr": addr, "port": store.port, "id": group_id}))
        return store, group_id, (addr, store.port)
    deadline = time.monotonic() + STORE_TIMEOUT_S
    while True:
        agent.wait([LEADER_KEY])
        leader = json.loads(agent.get(LEADER_KEY))
        try:
            probe = datetime.timedelta(seconds=CONNECT_S)
            store = dist.TCPStore(leader["addr"], int(leader["port"]), None, False, probe)
        except (RuntimeError, TimeoutError):  # the store of a group that has ended: rank 0 will publish its own
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0's store was not reachable within {STORE_TIMEOUT_S:.0f} s (last: {leader})")
            time.sleep(0.5)
            continue
        store.set_timeout(timeout)
        return store, leader["id"], (leader["addr"], int(leader["port"]))
