"""The warm update worker as a torchrun-launched group (issue 36 part 1): the README's one-node command,

    torchrun --standalone --nproc-per-node=2 --no-python ppoflow worker --stage update --stage checkpoint

serves a 2-iteration run's update and checkpoint stages (pipeline.stage_workers) on the loopback Prefect server.

What must hold, from the design rather than from the code's output:
- rank 0 alone is the worker Prefect knows: the only one listed as serving the update, the one each update
  manifest names; rank 1 (the agent's other child, RANK=1) is never listed;
- the group and its trainer are kept between iterations (one trainer build for the run);
- a run with another train.num_ranks is refused by name, and the group serves on;
- the run equals the same run on the existing train.num_ranks = 2 path (a group this process starts as rank 0):
  byte-equal checkpoints and the same metrics rows. Only where the ranks come from differs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
_NOT_COMPARED = ("time/", "timing/", "perf/", "ranks/group_starts")
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


def ranks_config(tmp_path: Path, name: str, model_dir, data_dir, on_workers: bool, zero_stage: int = 2):
    pipeline = {"stage_workers": ["update", "checkpoint"] if on_workers else []}
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
    from flows.records import read_stage_record
    from stages.manifests import UpdateManifest

    return [UpdateManifest.model_validate(read_stage_record(layout, i, "update")) for i in range(1, iterations + 1)]


def test_a_torchrun_group_serves_the_update_as_the_own_rank_group_does(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    import torch

    from engines.trainer import rank_group
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for

    log = tmp_path / "torchrun.log"
    # Started first: it boots (imports, rendezvous, Prefect) while the reference runs in this process.
    agent = start_torchrun(log, ["--standalone", "--nproc-per-node=2"], ["--no-python", PPOFLOW])
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for the reference's rank 1, as torchrun's ranks
    torch.set_num_threads(1)
    try:
        # The reference: train.num_ranks = 2 in this process (rank 0 here, rank 1 its child).
        reference = ranks_config(tmp_path, "own-group", tiny_model_dir, digits_dataset_dir, on_workers=False)
        assert ppo_training(config=reference.model_dump(mode="json"), return_state=True).is_completed()
        rank_group.shutdown()

        (leader,) = serving_update(logs=(log,))
        ranks = ranks_of(agent.pid)
        assert sorted(ranks) == [0, 1] and leader == f"{socket.gethostname()}:{ranks[0]}", (leader, ranks)
        # A run whose train.num_ranks is not the group's size is refused by name, before any command: the group
        # serves on unharmed (the run below).
        workers = {"stage_workers": ["update", "checkpoint"]}
        one = small_config(str(tmp_path / "runs"), "one-rank", tiny_model_dir, digits_dataset_dir, 1, pipeline=workers)
        state = ppo_training(config=one.model_dump(mode="json"), return_state=True)
        assert state.is_failed() and "train.num_ranks=1 but this update worker is a torchrun group of 2" in str(
            state.message
        ), state
        cfg = ranks_config(tmp_path, "torchrun-group", tiny_model_dir, digits_dataset_dir, on_workers=True)
        state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
        assert state.is_completed(), f"{state}\n{log.read_text()[-4000:]}"
        assert serving_update() == [leader]  # rank 1 never registered with Prefect
        assert ranks_of(agent.pid) == ranks  # the same two processes throughout
    finally:
        torch.set_num_threads(threads)
        rank_group.shutdown()
        stop_workers([agent])

    updates = update_manifests(layout_for(cfg))
    assert [u.worker for u in updates] == [leader] * ITERATIONS
    assert [u.metrics["ranks/world_size"] for u in updates] == [2.0] * ITERATIONS
    assert updates[0].engine_builds == updates[1].engine_builds  # the trainer was built once, then kept

    mine, theirs = layout_for(cfg), layout_for(reference)
    assert _digests(Path(mine.checkpoint_dir(ITERATIONS))) == _digests(Path(theirs.checkpoint_dir(ITERATIONS)))
    rows, reference_rows = read_metrics(mine), read_metrics(theirs)
    assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
    for row, reference_row in zip(rows, reference_rows, strict=True):
        assert "loss/policy" in compared(row)
        ours, expected = compared(row), compared(reference_row)
        assert ours == expected, [(k, ours.get(k), expected.get(k)) for k in ours.keys() | expected.keys()
                                  if ours.get(k) != expected.get(k)]  # fmt: skip
