"""Warm workers that die, grown from test_stage_workers.py's update-worker kill (issue 40): the rollout worker and
the score worker are SIGKILLed in the middle of iteration 3's stage of a pipelined run (k = 1, 4 iterations), and a
run whose rollout no worker serves at all.

What must hold:
- the flow run ends Failed within a bounded time (it hung for good before: iteration 4's stage waited in the dead
  worker's queue), with one message naming the stage and the dead worker `host:pid`, and `ppoflow train`'s one
  failure message with the resume command;
- after the worker is started again, `prefect flow-run retry` resumes to a final checkpoint byte-equal to an
  uninterrupted k = 1 run's, with the same metrics rows;
- a busy worker still counts as serving its stage (a submission queued behind it is not "no worker");
- a stage that no worker serves fails by name (and the command that starts one) instead of waiting forever, and a
  worker started later does not run the submission the flow gave up on;
- a stage that raises on a worker is retried there by the run's pipeline.retries (tasks/retries.py: the rule an
  in-process stage follows; the worker has no retry setting of its own): the run completes, equal to the
  uninterrupted one, and Prefect shows the task run's second attempt.

One set of workers and one uninterrupted run serve every case; each killed worker is replaced by one that SIGKILLs
itself at its 3rd stage body (tests/fixtures/kill_cli.py). The first test, without a server, is the rule that stops
the iterations after a failed one (runtime/in_flight.earlier_failure).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from bench.processes import stop_workers
from tests.fixtures.warm_python import prefect_cli
from tests.integration.test_pipeline_crash import COMPARED, _digests
from tests.integration.test_stage_workers import WORKERS, _env, _start_worker, _worker_config

ITERATIONS = 4
KILLS = {"rollout": "stages.rollout:run_rollout@3", "score": "stages.score:run_score@3"}
ENDS_WITHIN_S = 180  # the killed runs end in well under a minute when idle; this machine is shared and slow


def _train_within(cfg, logs: Path, timeout_s: float = ENDS_WITHIN_S):
    """ppo_training(cfg) in a thread (this test's Prefect settings carried over): its final state, or an assertion
    error, with the ends of the workers' logs in `logs`, when it is still running after timeout_s (a hang: its
    thread is left behind)."""
    from flows.training import ppo_training

    out = {}

    def train() -> None:
        out["state"] = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(train,), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in sorted(logs.glob("*.log")))
        raise AssertionError(f"run {cfg.run.name} was still running after {timeout_s} s\n{tails}")
    return out["state"]


def _picked_up_within(pickup_s: float, cfg):
    """`cfg` with pipeline.deadlines.pickup_s set: how long a submission may wait with no worker present."""
    deadlines = cfg.pipeline.deadlines.model_copy(update={"pickup_s": pickup_s})
    return cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"deadlines": deadlines})})


def _served(worker: subprocess.Popen, stages: list[str], timeout_s: float = 180) -> None:
    """Wait until `worker` is listed at the Prefect server as serving each of `stages`."""
    from tasks.leases import serving_workers
    from tasks.stage_tasks import STAGE_TASKS

    me = f"{socket.gethostname()}:{worker.pid}"
    deadline = time.monotonic() + timeout_s
    while not all(me in (serving_workers(STAGE_TASKS[s].task_key) or []) for s in stages):
        assert worker.poll() is None and time.monotonic() < deadline, f"worker {me} never served {stages}"
        time.sleep(0.5)


class _PresenceWatch:
    """Counts, while a run goes on, the moments at which a stage had no worker serving it (busy ones included)."""

    def __init__(self, stages: list[str]):
        from tasks.stage_tasks import STAGE_TASKS

        self.keys = {s: STAGE_TASKS[s].task_key for s in stages}
        self.missing: list[str] = []
        self.polls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._poll,), daemon=True)

    def _poll(self) -> None:
        from tasks.leases import serving_workers

        while not self.stop.wait(0.25):
            self.polls += 1
            self.missing += [s for s, key in self.keys.items() if serving_workers(key) == 0]

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def test_an_iteration_that_ended_without_its_commit_stops_the_ones_after_it(tmp_path):
    from prefect.futures import PrefectConcurrentFuture
    from prefect.states import Failed

    from engines.toy.run_config import toy_config
    from runtime.in_flight import earlier_failure, mark_committed, register_in_flight
    from storage.layout import layout_for

    cfg = toy_config(tmp_path / "runs", "in-flight", tmp_path / "model", tmp_path / "data")
    run_dir = layout_for(cfg).run_dir
    slots = {i: concurrent.futures.Future() for i in (3, 4, 5)}  # as Prefect's thread-pool task runner makes them
    for iteration, slot in slots.items():
        register_in_flight(run_dir, iteration, PrefectConcurrentFuture(uuid.uuid4(), slot))
    try:
        assert earlier_failure(cfg, 5) is None  # all running
        mark_committed(cfg, 3)
        slots[3].set_result(Failed(message="eval raised"))  # after its commit: the next update trains on
        assert earlier_failure(cfg, 5) is None
        slots[4].set_result(Failed(message="worker vm:7 is gone"))
        assert earlier_failure(cfg, 5) == "iteration 4 ended Failed (worker vm:7 is gone)"
        assert earlier_failure(cfg, 4) is None and earlier_failure(cfg, 3) is None  # only later iterations stop
    finally:
        for iteration in slots:
            register_in_flight(run_dir, iteration, None)


def _score_run_counts(run: str) -> dict[int, int]:
    """iteration -> run_count (attempts) of the completed score task run of each of `run`'s iteration subflows."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName

    counts = {}
    with get_client(sync_client=True) as client:
        for flow_run in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=f"{run}/iter-"))
        ):
            iteration = int(flow_run.name.rsplit("-", 1)[1])
            names = TaskRunFilterName(any_=[f"score-iter-{iteration}"])
            for task_run in client.read_task_runs(
                flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]}), task_run_filter=TaskRunFilter(name=names)
            ):
                if task_run.state.is_completed():
                    counts[iteration] = task_run.run_count
    return counts


def _subflow_message(run: str, iteration: int) -> str:
    """The state message of iteration `iteration`'s subflow run of `run` (the latest of that name)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    name = f"{run}/iter-{iteration:04d}"
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])), sort=FlowRunSort.START_TIME_DESC
        )
    assert runs, f"no flow run {name}"
    return runs[0].state.message or ""


@pytest.mark.slow
def test_killed_rollout_and_score_workers_fail_the_pipelined_run_by_name_and_a_retry_resumes_exactly(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from flows.failure import describe_failure
    from flows.records import read_metrics
    from storage.layout import layout_for
    from tasks.leases import read_lease

    host = socket.gethostname()
    served = {name: stage_names for name, stage_names in WORKERS.items() if name != "rollout"}
    workers = {name: _start_worker(tmp_path, name, stage_names) for name, stage_names in served.items()}
    try:
        # No rollout worker yet: the run's first stage fails by name instead of waiting, its submission cancelled.
        _served(workers["score"], ["score"])
        _served(workers["train"], ["update", "checkpoint"])
        unserved = _picked_up_within(
            5.0, _worker_config(tmp_path, "no-rollout-worker", tiny_model_dir, digits_dataset_dir, 0, 1)
        )
        state = _train_within(unserved, tmp_path, 120)
        assert state.is_failed(), state
        with pytest.raises(
            Exception,
            match=r"stage rollout of iteration 1 was not taken by any worker.*"
            r"`ppoflow worker --stage rollout`",
        ):
            state.result()

        # The uninterrupted k = 1 run. With pickup_s = 0 any moment a submission waited and the server listed no
        # worker for its stage would fail it: a busy worker (it holds no subscription for work then) must count.
        workers["rollout"] = _start_worker(tmp_path, "rollout", WORKERS["rollout"])
        _served(workers["rollout"], ["rollout"])
        clean = _picked_up_within(
            0.0, _worker_config(tmp_path, "clean", tiny_model_dir, digits_dataset_dir, 1, ITERATIONS)
        )
        with _PresenceWatch(["rollout", "score", "update"]) as watch:
            state = _train_within(clean, tmp_path)
        assert state.is_completed(), state
        assert watch.polls > 20 and not watch.missing, (watch.polls, watch.missing)
        # The started rollout worker was handed the submission the first run gave up on, and did not run it.
        assert read_lease(layout_for(unserved), 1, "rollout") is None
        assert "Cancelled" in (tmp_path / "rollout.log").read_text()

        # The killed runs: what ends them must be the failed iteration 3 (runtime/in_flight.earlier_failure), not the
        # dead worker's absence, so the latter is given no time to act.
        for victim, kill in KILLS.items():
            stop_workers([workers.pop(victim)])
            killer = _start_worker(tmp_path, victim, WORKERS[victim], kill=kill)
            _served(killer, [victim])
            killed = _picked_up_within(
                1e9, _worker_config(tmp_path, f"killed-{victim}", tiny_model_dir, digits_dataset_dir, 1, ITERATIONS)
            )
            started = time.monotonic()
            state = _train_within(killed, tmp_path)
            ended_s = time.monotonic() - started
            assert killer.wait(timeout=60) == -signal.SIGKILL
            assert state.is_failed(), (victim, state)
            with pytest.raises(Exception) as failure:
                state.result()
            assert f"stage {victim} of iteration 3 was running on a warm worker that died" in str(failure.value)
            assert f"worker {host}:{killer.pid} is gone" in str(failure.value)
            printed = describe_failure(failure.value, killed, None, argv=["train", "run.yaml"])
            assert printed.count("ppoflow: error:") == 1 and "resume:  ppoflow train run.yaml" in printed, printed
            assert read_metrics(layout_for(killed))[-1]["iteration"] == 2, victim
            # Iteration 4 (in flight) did not wait for the dead worker: its stage there was not run.
            assert "of iteration 4 was not run: iteration 3 ended Failed" in _subflow_message(f"killed-{victim}", 4)
            print(f"{victim} worker killed: the run ended Failed after {ended_s:.0f} s")

            workers[victim] = _start_worker(tmp_path, victim, WORKERS[victim])
            _served(workers[victim], [victim])
            entrypoint = ["--entrypoint", "flows/training.py:ppo_training"]
            retry = prefect_cli(
                "flow-run", "retry", str(state.state_details.flow_run_id), *entrypoint, env=_env(), timeout_s=600
            )
            assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]

            resumed, reference = layout_for(killed), layout_for(clean)
            assert _digests(Path(resumed.checkpoint_dir(ITERATIONS))) == _digests(
                Path(reference.checkpoint_dir(ITERATIONS))
            ), victim
            rows, clean_rows = read_metrics(resumed), read_metrics(reference)
            assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1)), victim
            for row, clean_row in zip(rows, clean_rows, strict=True):
                for key in (*COMPARED, "async/staleness"):
                    assert row[key] == clean_row[key], (victim, row["iteration"], key)

        # A score stage that raises once (iteration 3's, the worker's 3rd) is retried on its worker by the run's
        # pipeline.retries = 1, after retry_delay_s: the run completes as if nothing had failed.
        stop_workers([workers.pop("score")])
        workers["score"] = _start_worker(tmp_path, "score", WORKERS["score"], kill="raise=" + KILLS["score"])
        _served(workers["score"], ["score"])
        retried = _worker_config(tmp_path, "retried-score", tiny_model_dir, digits_dataset_dir, 1, ITERATIONS)
        retried = retried.model_copy(
            update={"pipeline": retried.pipeline.model_copy(update={"retries": 1, "retry_delay_s": 0.5})}
        )
        state = _train_within(retried, tmp_path)
        assert state.is_completed(), state
        assert _score_run_counts("retried-score") == {1: 1, 2: 1, 3: 2, 4: 1}
        assert _digests(Path(layout_for(retried).checkpoint_dir(ITERATIONS))) == _digests(
            Path(layout_for(clean).checkpoint_dir(ITERATIONS))
        )
        assert "injected fault at raise=stages.score:run_score@3" in (tmp_path / "score.log").read_text()
    finally:
        stop_workers(list(workers.values()))
