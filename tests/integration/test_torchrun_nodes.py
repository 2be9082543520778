"""Two "nodes" of one torchrun update group on this machine (issue 36 part 1): two torchrun agents, each
--nnodes=2 --nproc-per-node=1, meeting at a c10d rendezvous on loopback, are the warm update worker (ZeRO-3, the stage
whose save is itself a collective) of a clean 2-iteration run, then of a run whose rank 1 is SIGKILLed in the middle
of iteration 2's update (tests/fixtures/kill_cli.py: a fault from outside the product).

What must hold, from the design rather than from the code's output:
- the killed run ends Failed, its update stage of iteration 2 named with what happened (nothing past iteration 1 is
  committed);
- torchrun restarts the whole group (--max-restarts=1): every rank is a new process, rank 0 too, and the new rank 0
  registers with Prefect as the update worker; rank 1 never does;
- `prefect flow-run retry` (the README's command) resumes the run on the restarted group, and it ends with the
  clean run's checkpoint, byte for byte, and metrics rows. The clean run's trainers and the killed run's first ones
  were built in the same processes one after the other with no ZeRO-3 numbering handed from rank 0 to rank 1
  (torchrun_group.py: the ranks count in lockstep).
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from bench.processes import stop_workers
from tests.fixtures.warm_python import prefect_cli
from tests.integration.test_pipeline_crash import _digests
from tests.integration.test_torchrun_worker import (
    ITERATIONS,
    compared,
    ranks_config,
    ranks_of,
    serving_update,
    start_torchrun,
    torchrun_env,
    update_manifests,
)
from tests.integration.test_worker_kills import _train_within

pytestmark = pytest.mark.slow


def _listed_rank_0(agents, logs, other_than: str | None = None, timeout_s: float = 240):
    """(`host:pid` of the group's rank 0, {RANK: pid} of both agents' ranks, each agent's {RANK: pid}) once both ranks
    run and the server lists that rank 0, and only it, as serving the update (not `other_than`). An update worker of
    an earlier test on this session's server can stay listed for a moment after its process ended
    (test_torchrun_worker.serving_as_rank_0 waits the same way for one agent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        placed = [ranks_of(agent.pid) for agent in agents]
        ranks = {rank: pid for each in placed for rank, pid in each.items()}
        leader = f"{socket.gethostname()}:{ranks[0]}" if 0 in ranks else None
        listed = serving_update(timeout_s=timeout_s, other_than=other_than, logs=logs)
        if sorted(ranks) == [0, 1] and leader != other_than and listed == [leader]:
            return leader, ranks, placed
        if time.monotonic() > deadline:
            raise AssertionError(f"rank 0 of {ranks} is not the one update worker listed: {listed}")
        time.sleep(0.5)


# Rank 1's 4th update reads its rows: the clean run's iterations 1-2, the killed run's 1, then its 2. Rank 0 reads
# every row with read_shards and never calls it; a restarted rank 1 counts from 0 again.
KILL = "stages.update_ranks:read_rank_rows@4"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_killed_on_another_node_restarts_the_group_and_the_retry_resumes_exactly(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for

    rendezvous = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
    ]
    launcher = [*rendezvous, "--rdzv-id=ppoflow-two-nodes", "--max-restarts=1"]
    logs = (tmp_path / "node-a.log", tmp_path / "node-b.log")
    agents = [start_torchrun(log, launcher, ["-m", "tests.fixtures.kill_cli", KILL]) for log in logs]
    try:
        leader, first, placed = _listed_rank_0(agents, logs)
        clean = ranks_config(tmp_path, "clean", tiny_model_dir, digits_dataset_dir, on_workers=True, zero_stage=3)
        assert ppo_training(config=clean.model_dump(mode="json"), return_state=True).is_completed()

        killed = ranks_config(tmp_path, "killed", tiny_model_dir, digits_dataset_dir, on_workers=True, zero_stage=3)
        state = _train_within(killed, tmp_path)
        assert state.is_failed(), state
        print(f"the killed run ended: {state.message}")
        # Whichever comes first: rank 0's collective breaks (the stage fails with the group's error), or torchrun
        # stops rank 0 (its lease names the dead worker), or torchrun stops rank 0 after its body failed and before
        # its Failed state reached the server (the run stays Running with no lease: runtime/stage_runs._WorkerWatch).
        assert "update stage of iteration 2 failed" in state.message, state.message
        assert (
            ("the torchrun update group of 2 ranks failed" in state.message and "torchrun restarts" in state.message)
            or f"worker {leader} is gone" in state.message
            or "without its final state reaching the Prefect server" in state.message
        ), state.message
        assert [r["iteration"] for r in read_metrics(layout_for(killed))] == [1]

        restarted, again, _ = _listed_rank_0(agents, logs, other_than=leader)  # rank 0 of the restarted group
        assert not set(again.values()) & set(first.values()), (first, again)  # every rank is a new process
        follower_log = next(log for log, ranks in zip(logs, placed) if 1 in ranks)  # rank 1's agent saw it die
        assert f"exitcode: -{int(signal.SIGKILL)}" in follower_log.read_text(), follower_log.read_text()[-3000:]

        entrypoint = ["--entrypoint", "flows/training.py:ppo_training"]
        flow_run_id = str(state.state_details.flow_run_id)
        retry = prefect_cli("flow-run", "retry", flow_run_id, *entrypoint, env=torchrun_env(), timeout_s=600)
        assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
        assert all(agent.poll() is None for agent in agents)  # the group lives on after the retry
    finally:
        stop_workers(agents)

    resumed, reference = layout_for(killed), layout_for(clean)
    assert [u.worker for u in update_manifests(resumed)] == [leader, restarted]
    assert _digests(Path(resumed.checkpoint_dir(ITERATIONS))) == _digests(Path(reference.checkpoint_dir(ITERATIONS)))
    rows, clean_rows = read_metrics(resumed), read_metrics(reference)
    assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
    for row, clean_row in zip(rows, clean_rows, strict=True):
        assert compared(row) == compared(clean_row), row["iteration"]
