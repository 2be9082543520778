"""Where the update's ranks run: `train.hostfile` read into a Placement.

The hostfile has DeepSpeed's format, one node per line (blank lines and `#` comments are skipped):

    node-a slots=8      # node 0: the machine of rank 0 (the stage's own process); it starts ranks 1..7
    node-b slots=8      # node 1: ranks 8..15, started by `ppoflow rank-agent --master node-a:29500 --node 1`

Ranks are numbered node by node, in file order; a node's local ranks are 0..slots-1 (its GPU indices).
Errors are ValueError naming the file and the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"^(?P<host>[^\s#=]+)\s+slots\s*=\s*(?P<slots>\d+)$")


@dataclass(frozen=True)
class Node:
    """One machine of the group: its host name and how many ranks run there."""

    host: str
    slots: int


@dataclass(frozen=True)
class Placement:
    """The nodes of a rank group (node 0 is this machine) and the address the other nodes reach it at."""

    nodes: tuple[Node, ...]
    master_addr: str
    master_port: int

    @property
    def world(self) -> int:
        return sum(node.slots for node in self.nodes)

    @property
    def remote(self) -> bool:
        """Whether any rank runs on another node (then a rank agent there starts it)."""
        return len(self.nodes) > 1

    def first_rank(self, node: int) -> int:
        return sum(n.slots for n in self.nodes[:node])

    def ranks_of(self, node: int) -> range:
        start = self.first_rank(node)
        return range(start, start + self.nodes[node].slots)

    def node_of(self, rank: int) -> int:
        for index in range(len(self.nodes)):
            if rank in self.ranks_of(index):
                return index
        raise ValueError(f"rank {rank} is not placed: the group has {self.world} ranks")


def one_node(world: int) -> Placement:
    """Every rank on this machine, rendezvousing on loopback (the port is picked when the group starts)."""
    return Placement((Node("localhost", world),), "127.0.0.1", 0)


def read_hostfile(path: str) -> tuple[Node, ...]:
    """The nodes listed in `path`; ValueError naming the file and line of a bad entry, or an empty file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"train.hostfile {path!r} cannot be read: {e.strerror or e}") from None
    nodes, seen = [], set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"train.hostfile {path}:{number}: {raw.strip()!r} is not `<host> slots=<count>`")
        host, slots = match["host"], int(match["slots"])
        if slots < 1:
            raise ValueError(f"train.hostfile {path}:{number}: {host} has slots={slots}; a node needs at least 1")
        if host in seen:
            raise ValueError(f"train.hostfile {path}:{number}: {host} is listed twice")
        seen.add(host)
        nodes.append(Node(host, slots))
    if not nodes:
        raise ValueError(f"train.hostfile {path} lists no node (one `<host> slots=<count>` per line)")
    return tuple(nodes)


def placement_for(train) -> Placement:
    """The placement of a TrainConfig: its hostfile's nodes, or all train.num_ranks ranks on this machine.

    ValueError when the hostfile's slots do not add up to train.num_ranks (both named).
    """
    if train.hostfile is None:
        return one_node(train.num_ranks)
    nodes = read_hostfile(train.hostfile)
    slots = sum(node.slots for node in nodes)
    if slots != train.num_ranks:
        raise ValueError(
            f"train.hostfile {train.hostfile} places {slots} ranks "
            f"({', '.join(f'{n.host}: {n.slots}' for n in nodes)}) but train.num_ranks={train.num_ranks}"
        )
    if len(nodes) == 1:
        return one_node(slots)
    return Placement(nodes, train.master_addr or nodes[0].host, train.master_port)
