"""bench/pools.py's figures from hand-made driver output: the dispatch cost is the flow's view of a stage minus
the stage body's own seconds, and the worker checks read host:pid and engine_builds off the stage records.
(The bench itself needs a Prefect server and worker processes; tests/integration/test_stage_workers.py runs
that path for real.)"""

import socket

from bench.pools import STAGES, timings, worker_checks

HOST = socket.gethostname()


def _run(flow_s, body_s, ends, worker=lambda stage, i: f"{HOST}:1", builds=lambda stage, i: 2):
    """Driver output: flow_s[i] / body_s[i] are every stage's seconds in iteration i+1."""
    rows = [{"time/finished_unix": end, **{f"timing/{s}": flow_s[i] for s in STAGES}} for i, end in enumerate(ends)]
    records = {
        s: [{"seconds": body_s[i], "worker": worker(s, i), "engine_builds": builds(s, i)} for i in range(len(ends))]
        for s in STAGES
    }
    return {"rows": rows, "records": records, "t0": 100.0, "pids": {"rollout": 11, "score": 12, "train": 13}}


def test_timings_by_hand():
    # Iteration 1: flow 3.0 s, body 1.0 s (first dispatch 2000 ms). Later: flow - body = 0.25, 0.5, 0.5 s.
    data = _run(flow_s=[3.0, 1.25, 2.5, 1.5], body_s=[1.0, 1.0, 2.0, 1.0], ends=[110.0, 115.0, 121.0, 126.0])
    t = timings(data)
    assert t["startup_s"] == 10.0  # 110 - t0 100
    assert t["s_per_iter"] == 5.0  # median of the gaps 5, 6, 5
    assert t["dispatch_ms"] == 500.0  # median of 250, 500, 500 for each of the four stages
    assert t["dispatch_ms_by_stage"] == {s: 500.0 for s in STAGES}
    assert t["first_dispatch_ms"] == {s: 2000.0 for s in STAGES}
    assert t["body_s_by_stage"] == {s: 1.0 for s in STAGES}  # median of 1, 2, 1


def test_warm_checks_find_a_stage_off_its_worker_and_a_rebuild():
    pid = {"rollout": 11, "score": 12, "update": 13, "checkpoint": 10}  # WARM_GROUPS; the checkpoint in the flow
    good = _run([1.0] * 3, [0.5] * 3, [1.0, 2.0, 3.0], worker=lambda s, i: f"{HOST}:{pid[s]}")
    assert worker_checks("warm", good) == {
        "engine_builds": {s: [2, 2, 2] for s in STAGES},
        "all_on_their_worker": True,
        "no_rebuild_after_first": True,
    }
    off = _run([1.0] * 3, [0.5] * 3, [1.0, 2.0, 3.0], worker=lambda s, i: f"{HOST}:{12 if s == 'update' else pid[s]}")
    assert worker_checks("warm", off)["all_on_their_worker"] is False
    # the checkpoint belongs in the flow: on the trainer's worker it is off its place too
    on_trainer = _run(
        [1.0] * 3, [0.5] * 3, [1.0, 2.0, 3.0], worker=lambda s, i: f"{HOST}:{13 if s == 'checkpoint' else pid[s]}"
    )
    assert worker_checks("warm", on_trainer)["all_on_their_worker"] is False
    rebuilt = _run(
        [1.0] * 3,
        [0.5] * 3,
        [1.0, 2.0, 3.0],
        worker=lambda s, i: f"{HOST}:{pid[s]}",
        builds=lambda s, i: 3 if (s, i) == ("update", 2) else 2,
    )
    assert worker_checks("warm", rebuilt)["no_rebuild_after_first"] is False


def test_pool_checks_want_a_new_process_per_stage_per_iteration():
    fresh = _run([1.0] * 2, [0.5] * 2, [1.0, 2.0], worker=lambda s, i: f"{HOST}:{STAGES.index(s) * 10 + i}")
    assert worker_checks("pools", fresh)["new_process_every_stage"] is True
    reused = _run([1.0] * 2, [0.5] * 2, [1.0, 2.0], worker=lambda s, i: f"{HOST}:7")
    assert worker_checks("pools", reused)["new_process_every_stage"] is False
