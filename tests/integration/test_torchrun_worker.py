"""Several update ranks are a torchrun group that is the warm update worker (issue 36 part 1), started either by the
training flow itself (train.num_ranks = 2, update on no worker: runtime/update_group.py) or by hand with the README's
one-node command,

    torchrun --standalone --nproc-per-node=2 --no-python ppoflow worker --stage update --stage checkpoint

serving 2-iteration runs' update and checkpoint stages on the loopback Prefect server (CPU, gloo, real DeepSpeed).

What must hold, from the design rather than from the code's output:
- a run with train.num_ranks = 2 and no stage workers gets a group the flow started: its updates run in a process
  other than this one, the trainer is built once for the run, and when the run ends the group is gone;
- 2 ranks take the 1-rank update: the same scored rows give the same old log-probs, values, advantages and returns
  (whitened over all rows on every rank, not per rank), the same losses and gradient norms, up to fp32 summation order;
- rank 1 SIGKILLed between stages (after iteration 1's checkpoint, before iteration 2's update is taken) and again in
  the middle of iteration 2's update (from outside: the test kills it when the update's lease appears): torchrun
  restarts the group each time, the update runs and is retried on the restarted group (a new rank 0 runs it), and
  the run commits the uninterrupted run's checkpoint byte for byte and its metrics rows;
- a group started by hand: rank 0 alone is the worker Prefect knows (rank 1 is never listed), a run with another
  train.num_ranks is refused by name and the group serves on, and its run equals the flow-started group's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.processes import stop_workers
from tests.integration.pipeline_helpers import small_config
from tests.integration.test_pipeline_crash import _digests

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 2
PPOFLOW = str(Path(sys.executable).with_name("ppoflow"))  # the console script beside this interpreter
_DISTRIBUTED_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# Metrics that say when or where, not what was computed; the score cache is shared by the runs.
_NOT_COMPARED = ("time/", "timing/", "perf/")
_CACHE = "cache"


def torchrun_env() -> dict:
    """This test's environment (PREFECT_API_URL included) without a launcher's variables; one OpenMP thread per
    rank, as the in-process reference runs (the same kernels give the same floats)."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


def start_torchrun(log: Path, launcher: list[str], program: list[str]) -> subprocess.Popen:
    """`torchrun LAUNCHER PROGRAM worker --stage update --stage checkpoint`, its output (the agent's and the ranks')
    appended to `log`; in a session of its own, so that stop_workers can end the agent and its ranks together."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--local-addr=127.0.0.1", *launcher, *program]
    return subprocess.Popen(
        [*argv, "worker", "--stage", "update", "--stage", "checkpoint"],
        cwd=REPO,
        env=torchrun_env(),
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def serving_update(timeout_s: float = 240, other_than: str | None = None, logs: tuple[Path, ...] = ()) -> list[str]:
    """The workers (`host:pid`) the Prefect server lists as serving the update stage, once it lists one (other than
    `other_than`, a worker that is to go away)."""
    from tasks.leases import serving_workers
    from tasks.stage_tasks import STAGE_TASKS

    deadline = time.monotonic() + timeout_s
    while True:
        listed = serving_workers(STAGE_TASKS["update"].task_key) or []
        if listed and other_than not in listed:
            return listed
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
            raise AssertionError(f"no update worker (other than {other_than}) after {timeout_s} s\n{tails}")
        time.sleep(0.5)


def serving_as_rank_0(agent: subprocess.Popen, log: Path, timeout_s: float = 240) -> tuple[str, dict[int, int]]:
    """(`host:pid` of the agent's rank 0, {RANK: pid}) once the server lists that rank 0, and only it, as serving the
    update (a group stopped just before may stay listed for a moment after its processes ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = ranks_of(agent.pid)
        leader = f"{socket.gethostname()}:{ranks[0]}" if 0 in ranks else None
        if serving_update(timeout_s=timeout_s, logs=(log,)) == [leader]:
            return leader, ranks
        if time.monotonic() > deadline:
            raise AssertionError(f"rank 0 of torchrun {agent.pid} ({ranks}) is not the one update worker listed")
        time.sleep(0.5)


def ranks_of(agent_pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes a torchrun agent started (read from their environment)."""
    import psutil

    ranks = {}
    for child in psutil.Process(agent_pid).children():
        env = Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
        rank = next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[rank] = child.pid
    return ranks


def ranks_config(
    tmp_path: Path, name: str, model_dir, data_dir, on_workers: bool, zero_stage: int = 2, retries: int = 0
):
    pipeline = {"stage_workers": ["update", "checkpoint"] if on_workers else [], "retries": retries}
    train = {"num_ranks": 2, "zero_stage": zero_stage}
    root = str(tmp_path / "runs")
    return small_config(root, name, model_dir, data_dir, iterations=ITERATIONS, train=train, pipeline=pipeline)


def compared(row: dict) -> dict:
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(_NOT_COMPARED) and _CACHE not in k and isinstance(v, (int, float))
    }


def update_manifests(layout, iterations: int = ITERATIONS):
    from stages.manifests import UpdateManifest
    from storage.stage_records import read_stage_record

    return [UpdateManifest.model_validate(read_stage_record(layout, i, "update")) for i in range(1, iterations + 1)]


def one_rank_reference_agrees(tmp_path: Path, model_dir, data_dir, two_ranks_layout) -> None:
    """The same run on one rank in this process: iteration 1 (both start from the initial weights and sample the
    same rows) gives the 2-rank numbers up to fp32 summation order.

    Each rank ran the old-log-prob and value forward on its own 8 of the 16 rows, padded to the whole batch's widths
    (log-probs ~4 nats in fp32: a few 1e-7 apart); the advantages are whitened over all 16 rows on every rank, so
    they agree as tightly. Whitening each rank's 8 rows apart would give each half a token mean of 0: off by that
    half's token mean, checked below to be far above the 1e-5 allowed. Same token-mean loss over the step's tokens,
    so the same gradient: its pre-clip norm too (a mean of per-rank means would halve it)."""
    import fsspec

    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for
    from storage.shards import read_shards

    one = small_config(str(tmp_path / "runs"), "one-rank", model_dir, data_dir, iterations=ITERATIONS)
    assert ppo_training(config=one.model_dump(mode="json"), return_state=True).is_completed()
    fs = fsspec.filesystem("file")
    experience = {
        name: read_shards(fs, layout.stage_dir(1, "experience")).to_pydict()
        for name, layout in (("two", two_ranks_layout), ("one", layout_for(one)))
    }
    assert experience["two"]["prompt_ids"] == experience["one"]["prompt_ids"]  # the same rows, in the same order
    for column in ("old_logprobs", "values", "advantages", "returns"):
        for row, (two_row, one_row) in enumerate(zip(experience["two"][column], experience["one"][column])):
            assert two_row == pytest.approx(one_row, abs=1e-5), (column, row)
    halves = [[a for row in experience["one"]["advantages"][h : h + 8] for a in row] for h in (0, 8)]
    assert max(abs(sum(half) / len(half)) for half in halves) > 1e-3  # the check above can tell the two apart
    two, one_row = read_metrics(two_ranks_layout)[0], read_metrics(layout_for(one))[0]
    for key in ("loss/policy", "loss/value"):
        assert two[key] == pytest.approx(one_row[key], abs=1e-5), key
    for key in ("optim/actor_grad_norm", "optim/critic_grad_norm"):
        assert two[key] == pytest.approx(one_row[key], rel=1e-4), key


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_rank_1_once(appears: Path, killed: dict, absent: Path | None = None) -> threading.Thread:
    """A thread that SIGKILLs rank 1 of the group this process started as soon as `appears` exists; its pid goes in
    `killed`, and with `absent`, whether that file did not exist yet at the kill (killed["idle"])."""
    from runtime.update_group import running

    def watch() -> None:
        deadline = time.monotonic() + 900
        while not appears.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        killed["pid"] = ranks_of(running().agent.pid)[1]
        if absent is not None:
            killed["idle"] = not absent.exists()
        os.kill(killed["pid"], signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True, name=f"kill-rank-1-at-{appears.name}")
    thread.start()
    return thread


def kill_rank_1_in_update(run_layout, iteration: int, killed: dict) -> threading.Thread:
    """Rank 1 SIGKILLed as soon as `iteration`'s update lease appears (rank 0 has taken the stage: rank 1 is building,
    reading its rows or training); its pid goes in `killed`."""
    from tasks.leases import lease_path

    return _kill_rank_1_once(Path(lease_path(run_layout, iteration, "update")), killed)


def kill_rank_1_between_stages(run_layout, iteration: int, killed: dict) -> threading.Thread:
    """Rank 1 SIGKILLed once `iteration`'s checkpoint stage is recorded and before the next update has a lease (the
    group idle, the flow sampling the next iteration); its pid goes in `killed`, with whether the next update's lease
    was still absent at the kill."""
    from storage.stage_records import stage_record_path
    from tasks.leases import lease_path

    record = Path(stage_record_path(run_layout, iteration, "checkpoint"))
    return _kill_rank_1_once(record, killed, absent=Path(lease_path(run_layout, iteration + 1, "update")))


def test_two_ranks_by_the_flow_or_by_hand_take_the_one_rank_update_and_survive_a_killed_rank(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    import torch

    from flows.records import read_metrics
    from flows.training import ppo_training
    from runtime.update_group import running
    from storage.layout import layout_for

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for the groups' ranks, as this process's one-rank reference
    torch.set_num_threads(1)
    try:
        # The flow starts its own group: no stage workers, train.num_ranks = 2.
        own = ranks_config(tmp_path, "own-group", tiny_model_dir, digits_dataset_dir, on_workers=False, retries=1)
        assert ppo_training(config=own.model_dump(mode="json"), return_state=True).is_completed()
        assert running() is None
        own_updates = update_manifests(layout_for(own))
        rank0 = int(own_updates[0].worker.rsplit(":", 1)[1])
        assert rank0 != os.getpid() and own_updates[1].worker == own_updates[0].worker
        assert _gone(rank0)  # the group was stopped with the run
        assert [u.metrics["ranks/world_size"] for u in own_updates] == [2.0] * ITERATIONS
        assert own_updates[0].engine_builds == own_updates[1].engine_builds  # the trainer was built once, then kept
        assert list((Path(layout_for(own).run_dir) / "logs").glob("update-group-*.log"))  # its output, not ours
        one_rank_reference_agrees(tmp_path, tiny_model_dir, digits_dataset_dir, layout_for(own))

        # Rank 1 killed twice: between stages (after iteration 1's checkpoint, the group idle) and in iteration 2's
        # update. Each time torchrun restarts the group; the update goes to the restarted one, and is retried there.
        killed_cfg = ranks_config(tmp_path, "killed", tiny_model_dir, digits_dataset_dir, on_workers=False, retries=2)
        idle_kill, update_kill = {}, {}
        killers = [
            kill_rank_1_between_stages(layout_for(killed_cfg), 1, idle_kill),
            kill_rank_1_in_update(layout_for(killed_cfg), 2, update_kill),
        ]
        state = ppo_training(config=killed_cfg.model_dump(mode="json"), return_state=True)
        for killer in killers:
            killer.join(timeout=5)
        assert idle_kill.get("idle") is True, f"rank 1 was not killed between stages: {idle_kill}"
        assert "pid" in update_kill, "iteration 2's update never started"
        assert update_kill["pid"] != idle_kill["pid"]  # the second kill met the restarted group's rank 1
        assert state.is_completed(), state
        updates = update_manifests(layout_for(killed_cfg))
        assert updates[1].worker != updates[0].worker  # a new rank 0: the restarted group ran the retry

        # A group started by hand serves a run with pipeline.stage_workers.
        log = tmp_path / "torchrun.log"
        agent = start_torchrun(log, ["--standalone", "--nproc-per-node=2"], ["--no-python", PPOFLOW])
        try:
            leader, ranks = serving_as_rank_0(agent, log)
            assert sorted(ranks) == [0, 1], ranks
            # A run whose train.num_ranks is not the group's size is refused by name, before any command: the group
            # serves on unharmed (the run below).
            workers = {"stage_workers": ["update", "checkpoint"]}
            one = small_config(
                str(tmp_path / "runs"), "one-on-2", tiny_model_dir, digits_dataset_dir, 1, pipeline=workers
            )
            state = ppo_training(config=one.model_dump(mode="json"), return_state=True)
            assert state.is_failed() and "train.num_ranks=1 but this update worker is a torchrun group of 2" in str(
                state.message
            ), state
            cfg = ranks_config(
                tmp_path, "torchrun-group", tiny_model_dir, digits_dataset_dir, on_workers=True, retries=1
            )
            state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
            assert state.is_completed(), f"{state}\n{log.read_text()[-4000:]}"
            assert serving_update() == [leader]  # rank 1 never registered with Prefect
            assert ranks_of(agent.pid) == ranks  # the same two processes throughout
        finally:
            stop_workers([agent])
    finally:
        torch.set_num_threads(threads)

    by_hand = update_manifests(layout_for(cfg))
    assert [u.worker for u in by_hand] == [leader] * ITERATIONS
    assert by_hand[0].engine_builds == by_hand[1].engine_builds

    # The killed run and the hand-started group's run both end as the flow-started group's uninterrupted run.
    reference = layout_for(own)
    for layout in (layout_for(killed_cfg), layout_for(cfg)):
        assert _digests(Path(layout.checkpoint_dir(ITERATIONS))) == _digests(Path(reference.checkpoint_dir(ITERATIONS)))
        rows, reference_rows = read_metrics(layout), read_metrics(reference)
        assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
        for row, reference_row in zip(rows, reference_rows, strict=True):
            assert "loss/policy" in compared(row)
            ours, expected = compared(row), compared(reference_row)
            assert ours == expected, [(k, ours.get(k), expected.get(k)) for k in ours.keys() | expected.keys()
                                      if ours.get(k) != expected.get(k)]  # fmt: skip


def test_the_group_a_flow_starts_ends_with_the_flow_when_it_is_interrupted(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    """Ctrl-C (KeyboardInterrupt; SIGTERM raises flows/failure.Terminated, one of them) in the middle of a run whose
    flow owns the group: torchrun's agent and both ranks are gone when the interrupt leaves the block."""
    from runtime.update_group import owned_update_group, running

    cfg = ranks_config(tmp_path, "interrupted", tiny_model_dir, digits_dataset_dir, on_workers=False)
    with pytest.raises(KeyboardInterrupt):
        with owned_update_group(cfg) as group:
            group.wait_ready()  # serving: rank 0 listed at the server, both ranks up
            pids = [group.agent.pid, *ranks_of(group.agent.pid).values()]
            assert len(pids) == 3 and running() is group
            raise KeyboardInterrupt
    assert running() is None
    assert [pid for pid in pids if not _gone(pid)] == []
