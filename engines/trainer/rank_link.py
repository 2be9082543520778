"""A rank's side of the update group (ranks 1..N-1): join from the environment its parent set, follow rank 0's
commands, report an error where rank 0 reads it. The protocol is in engines/trainer/rank_group.py's docstring.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Iterator

from engines.trainer.rank_wire import POLL_S, connect, group_store


class RankLink:
    """A rank's side of the group (ranks 1..N-1): joined from the environment its parent (rank 0, or its node's
    rank agent) set: `rank_env`."""

    def __init__(self):
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.parent = int(os.environ["PPOFLOW_RANK_PARENT"])
        timeout_s = float(os.environ["PPOFLOW_RANK_TIMEOUT_S"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        _check_parent(self.parent)
        self.store = group_store(connect(addr, port, timeout_s), os.environ["PPOFLOW_RANK_GROUP"])
        self.store.set(f"booted/{self.rank}", str(os.getpid()))
        from engines.trainer.deepspeed_setup import join_process_group

        local_rank = int(os.environ["LOCAL_RANK"])
        join_process_group(
            self.store, self.rank, self.world, timeout_s, local_rank=local_rank, master_addr=addr, master_port=port
        )

    def commands(self) -> Iterator[dict[str, Any]]:
        """Rank 0's commands in order, until {"op": "stop"} (or rank 0 is gone: then this process exits)."""
        n = 0
        while True:
            key = f"cmd/{n}"
            while not self._check(key):
                time.sleep(POLL_S)
            command = json.loads(self.store.get(key))
            n += 1
            if command.get("op") == "stop":
                return
            yield command

    def _check(self, key: str) -> bool:
        if os.getppid() != self.parent:  # rank 0 (or this node's agent) is gone
            os._exit(3)
        try:
            return self.store.check([key])
        except RuntimeError:  # the store went away with rank 0
            os._exit(3)

    def report(self, exc: BaseException) -> None:
        """Leave this rank's error where rank 0 reads it when it names the dead rank."""
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            self.store.set(f"err/{self.rank}", text[-2000:])
        except RuntimeError:
            pass


def _check_parent(parent: int) -> None:
    """Exit when `parent`, the process that started this rank, is already gone (it died before the rank came up).

    Not PR_SET_PDEATHSIG: Linux sends that signal when the THREAD that started the child ends, and rank 0 may
    start the group from a worker thread of a Prefect task runner that ends long before the process does.
    """
    if os.getppid() != parent:
        os._exit(3)


def run_rank(handle) -> None:
    """A rank's main: join, then `handle(command)` for every command; an error is reported and exits 1."""
    link = RankLink()
    try:
        for command in link.commands():
            handle(command)
    except BaseException as exc:
        link.report(exc)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # no atexit / destructor may block on a collective the others will never join
    os._exit(0)
