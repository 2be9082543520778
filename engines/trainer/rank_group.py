"""A group of data-parallel ranks that stays up between update stages.

This process is rank 0. Ranks 1..N-1 are child processes (`python -m <entry module>`) started once, at the
first update, and kept until the process ends, a rank dies, or another number of ranks is asked for; then
they are torn down and a new group is started. Between iterations they wait for a command:

    group = rank_group.group_for(world, entry, timeout_s)  the running group, or a new one (RankDiedError
                                                            naming a rank that died since the last stage)
    group.send({"op": ...})             one small JSON command to every rank
    rank_group.failed(exc)              after an exception: the error to raise; the group is torn down
    rank_group.shutdown()               stop the ranks (also at interpreter exit)

    link = RankLink.join()              in a rank process: join the group; `for cmd in link.commands()`

Launcher: torchrun and DeepSpeed's `deepspeed` launcher both start EVERY rank as their own children and own
their lifetime (they end when the script ends). Here rank 0 must be the process that already runs the stage
(the in-process pipeline, or a warm `ppoflow worker --stage update`), and the group must outlive one stage,
so neither fits. The group uses the same contract they use instead: torch.distributed's rendezvous over a
c10d TCPStore on loopback (rank 0 hosts it, the env variables RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT are set as a launcher sets them) and DeepSpeed adopting that process group
(deepspeed_setup.join_process_group). One node only: MASTER_ADDR is 127.0.0.1.

Commands travel through the same TCPStore (key cmd/<n>), not through a collective: a rank may wait for the
next iteration far longer than any collective timeout (rollout and scoring run in between). They are JSON
(no pickle), a few hundred bytes: references to storage, never tensors. A rank that fails a command writes
its error to the store (err/<rank>) and exits 1; rank 0 then names it. Ranks end with rank 0: while
waiting for a command they check their parent pid, and in a collective gloo/NCCL fail when its sockets close.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional

from engines.trainer.deepspeed_setup import leave_process_group

_BOOT_S = 300.0  # ranks 1..N-1 importing torch / DeepSpeed / transformers on a busy machine
_POLL_S = 0.02
_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankDiedError(RuntimeError):
    """A rank of the update's group exited; the message names it, its exit code or signal, and its last words."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by signal {name} ({-code})"
    return f"exited with code {code}"


def _store(port: int, is_master: bool, timeout_s: float):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if is_master:
        return dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, None, False, timeout)


class RankGroup:
    """Ranks 1..world-1 as child processes and this process as rank 0 of one torch.distributed group."""

    def __init__(self, world: int, entry: str, timeout_s: float):
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() < world:
            raise ValueError(
                f"train.num_ranks={world} needs one GPU per rank on this machine, but it has "
                f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        self.world = world
        self.timeout_s = timeout_s
        self.store = _store(0, True, timeout_s)  # port 0: the OS picks a free port, no race with others
        self.log_dir = Path(tempfile.mkdtemp(prefix="ppoflow-ranks-"))
        self.holds: Optional[str] = None  # identity of the weights every rank's trainer holds (set by the stage)
        self._sent = 0
        self._saved_env = {key: os.environ.get(key) for key in _ENV_KEYS}
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, world):
            self.procs[rank] = self._spawn(rank, entry)

    def _spawn(self, rank: int, entry: str) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[2])  # the checkout holding engines/, for `python -m`
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.store.port),
            PPOFLOW_RANK_TIMEOUT_S=str(self.timeout_s),
            PPOFLOW_RANK_PARENT=str(os.getpid()),
            PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p),
        )
        log = open(self.log_dir / f"rank{rank}.log", "wb")
        try:
            return subprocess.Popen([sys.executable, "-m", entry], env=env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    @property
    def pids(self) -> dict[int, int]:
        """{rank: pid} of ranks 1..N-1 (rank 0 is this process)."""
        return {rank: proc.pid for rank, proc in self.procs.items()}

    def join(self) -> None:
        """Wait until every rank has started (naming one that died first), then join the process group."""
        from engines.trainer.deepspeed_setup import join_process_group

        deadline = time.monotonic() + min(_BOOT_S, self.timeout_s)
        waiting = set(self.procs)
        while waiting:
            self.check_alive()
            waiting = {r for r in waiting if not self.store.check([f"booted/{r}"])}
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"update ranks {sorted(waiting)} did not start within {min(_BOOT_S, self.timeout_s):.0f} s "
                    f"(logs in {self.log_dir})"
                )
            time.sleep(_POLL_S)
        join_process_group(self.store, 0, self.world, self.timeout_s)

    def check_alive(self) -> None:
        """RankDiedError naming the first rank that has exited (its exit code or signal, its last log lines)."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise RankDiedError(self._death_message(rank, code), rank)

    def _death_message(self, rank: int, code: int) -> str:
        reported = ""
        try:
            if self.store.check([f"err/{rank}"]):
                reported = ": " + self.store.get(f"err/{rank}").decode(errors="replace")
        except RuntimeError:
            pass
        log_path = self.log_dir / f"rank{rank}.log"
        tail = ""
        if log_path.is_file():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        return (
            f"update rank {rank} of {self.world} (pid {self.procs[rank].pid}) {_describe_exit(code)}{reported}\n"
            f"last lines of {log_path}:\n{tail}"
        )

    def send(self, command: dict[str, Any]) -> None:
        """Hand `command` (JSON-able) to ranks 1..N-1; RankDiedError first if one of them has exited."""
        self.check_alive()
        self.store.set(f"cmd/{self._sent}", json.dumps(command))
        self._sent += 1

    def dead_rank(self, grace_s: float) -> Optional[RankDiedError]:
        """The error naming a rank that has exited, waiting up to `grace_s` for one (after a failed collective,
        the rank that broke it may still be on its way out); None when all live."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self.check_alive()
            except RankDiedError as died:
                return died
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    def close(self, graceful: bool) -> None:
        """Stop ranks 1..N-1 (a stop command first when `graceful`, else SIGKILL), then leave the process group."""
        if graceful and all(p.poll() is None for p in self.procs.values()):
            try:
                self.store.set(f"cmd/{self._sent}", json.dumps({"op": "stop"}))
            except RuntimeError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10 if graceful else 0.01)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
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


def group_for(world: int, entry: str, timeout_s: float) -> RankGroup:
    """The running group of `world` ranks, else a new one (an old group of another size is stopped first).

    A group with a rank that died since the last stage is torn down and RankDiedError names the rank: the stage
    fails, and its retry starts a new group (whose trainers are built from the committed checkpoint).
    A new group drops this process's warm trainer: its DeepSpeed engines belong to the old process group.
    """
    global _group, _starts
    if _group is not None:
        if _group.world == world:
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
    group = RankGroup(world, entry, timeout_s)
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


class RankLink:
    """A rank's side of the group (ranks 1..N-1): joined from the environment its parent set."""

    def __init__(self):
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.parent = int(os.environ["PPOFLOW_RANK_PARENT"])
        timeout_s = float(os.environ["PPOFLOW_RANK_TIMEOUT_S"])
        _check_parent()
        self.store = _store(int(os.environ["MASTER_PORT"]), False, timeout_s)
        self.store.set(f"booted/{self.rank}", str(os.getpid()))
        from engines.trainer.deepspeed_setup import join_process_group

        join_process_group(self.store, self.rank, self.world, timeout_s)

    def commands(self) -> Iterator[dict[str, Any]]:
        """Rank 0's commands in order, until {"op": "stop"} (or rank 0 is gone: then this process exits)."""
        n = 0
        while True:
            key = f"cmd/{n}"
            while not self._check(key):
                time.sleep(_POLL_S)
            command = json.loads(self.store.get(key))
            n += 1
            if command.get("op") == "stop":
                return
            yield command

    def _check(self, key: str) -> bool:
        if os.getppid() != self.parent:  # rank 0 is gone (the death signal covers most cases; this the rest)
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


def _check_parent() -> None:
    """Exit when the parent that started this rank is already gone (it died before the rank came up).

    Not PR_SET_PDEATHSIG: Linux sends that signal when the THREAD that started the child ends, and rank 0 may
    start the group from a worker thread of a Prefect task runner that ends long before the process does.
    """
    if os.getppid() != int(os.environ["PPOFLOW_RANK_PARENT"]):
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
