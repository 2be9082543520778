"""Data-parallel rollout (pipeline.rollout_parts = N): the iteration's prompts in N part task runs, then a merge.

What must hold, from the design rather than from the code's output:
- the merged rollout table equals the one an unsplit rollout writes, row for row: every column exactly but the
  sampler's log-probs, which agree to fp32 rounding (each prompt has its own seed, and the parts are contiguous
  slices merged in order); so the trained weights are bitwise equal too (k = 0: the update recomputes log-probs);
- 8 prompts in 3 parts are 3 + 3 + 2 prompts (the first 8 % 3 parts take one more);
- with two warm rollout workers, an iteration's two parts run one on each worker (each manifest names its
  process, host:pid), and the run equals an in-process one;
- a rollout worker killed in the middle of its part fails the flow run with a message naming that worker and
  the part, instead of waiting for it forever; run again, only that part is sampled again (the other is cached).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from bench.processes import stop_workers
from tests.integration.pipeline_helpers import small_config
from tests.integration.test_pipeline_crash import COMPARED, _digests
from tests.integration.test_stage_workers import _start_worker

pytestmark = pytest.mark.slow


def _run(cfg):
    from flows.training import ppo_training

    return ppo_training(config=cfg.model_dump(mode="json"), return_state=True)


def _assert_same_run(layout, reference, iterations: int) -> None:
    """Every iteration's rollout table, the last checkpoint's files and the metrics rows equal the reference's."""
    from flows.records import read_metrics
    from storage.shards import read_shards

    for i in range(1, iterations + 1):
        merged = read_shards(layout.fs, layout.stage_dir(i, "rollout"))
        whole = read_shards(reference.fs, reference.stage_dir(i, "rollout"))
        assert merged.num_rows == whole.num_rows > 0
        exact = [c for c in whole.column_names if c != "rollout_logprobs"]
        assert merged.select(exact).equals(whole.select(exact)), i  # row for row (schema metadata names the run)
        # The HF sampler left-pads a batch to its longest prompt; a part's batch is padded to its own, and the fp32
        # sums over a differently padded row round differently (same-length prompts give equal bits). Seen: 4.8e-7,
        # 4 ulps at |log-prob| ~ 4; 1e-5 bounds such rounding, far below a changed token's or weight's effect.
        for got, expected in zip(merged["rollout_logprobs"].to_pylist(), whole["rollout_logprobs"].to_pylist()):
            assert got == pytest.approx(expected, abs=1e-5, rel=0), i
    last = iterations
    assert _digests(Path(layout.checkpoint_dir(last))) == _digests(Path(reference.checkpoint_dir(last)))
    for row, reference_row in zip(read_metrics(layout), read_metrics(reference), strict=True):
        for key in COMPARED:
            assert row[key] == reference_row[key], (row["iteration"], key)


def _part_manifests(layout, iteration: int, parts: int):
    from stages.manifests import RolloutPartManifest
    from storage.stage_records import read_stage_record
    from tasks.stage_tasks import part_stage_name

    return [
        RolloutPartManifest.model_validate(read_stage_record(layout, iteration, part_stage_name(p, parts)))
        for p in range(parts)
    ]


def test_parts_in_process_equal_one_rollout_and_train_the_same_weights(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from stages.manifests import RolloutManifest
    from storage.layout import layout_for
    from storage.stage_records import read_stage_record

    root = str(tmp_path / "runs")
    one = small_config(root, "one-part", tiny_model_dir, digits_dataset_dir, iterations=2)
    three = small_config(
        root, "three-parts", tiny_model_dir, digits_dataset_dir, iterations=2, pipeline={"rollout_parts": 3}
    )
    assert one.rollout.prompts_per_iteration == 8 and one.rollout.n_samples == 2
    for cfg in (one, three):
        assert _run(cfg).is_completed()
    split = layout_for(three)
    _assert_same_run(split, layout_for(one), iterations=2)
    here = f"{socket.gethostname()}:{os.getpid()}"
    for i in (1, 2):
        parts = _part_manifests(split, i, 3)
        assert [p.prompts for p in parts] == [3, 3, 2]  # 8 = 3 + 3 + 2
        assert [p.rows for p in parts] == [6, 6, 4]  # 2 samples a prompt
        merged = RolloutManifest.model_validate(read_stage_record(split, i, "rollout"))
        assert merged.rows == 16 and merged.part_workers == [here] * 3  # in-process: one after another, here


def _wait_for_task_workers(pids: list[int], timeout_s: float = 120.0) -> None:
    """Wait until the Prefect server lists a task worker of each process serving the rollout parts (subscribed)."""
    import httpx

    from tasks.stage_tasks import STAGE_TASKS

    wanted = {f"{socket.gethostname()}-{pid}" for pid in pids}  # Prefect's task worker id: host-pid
    url = f"{os.environ['PREFECT_API_URL']}/task_workers/filter"
    body = {"task_worker_filter": {"task_keys": [STAGE_TASKS["rollout-part"].task_key]}}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = {w["identifier"] for w in httpx.post(url, json=body).json()}
        if wanted <= listed:
            return
        time.sleep(0.5)
    raise TimeoutError(f"task workers {sorted(wanted)} did not subscribe within {timeout_s} s")


def test_two_rollout_workers_sample_one_part_each_and_a_dead_one_is_named(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from stages.manifests import RolloutManifest
    from storage.layout import layout_for
    from storage.stage_records import read_stage_record
    from tasks.leases import read_lease
    from tasks.stage_tasks import part_stage_name

    host = socket.gethostname()
    # The second worker SIGKILLs itself when it starts its second part (iteration 2's, below).
    workers = [
        _start_worker(tmp_path, "rollout-a", ["rollout"]),
        _start_worker(tmp_path, "rollout-b", ["rollout"], kill="stages.rollout_parts:run_rollout_part@2"),
    ]
    try:
        _wait_for_task_workers([w.pid for w in workers])
        root = str(tmp_path / "runs")
        pipeline = {"stage_workers": ["rollout"], "rollout_parts": 2}
        cfg = small_config(root, "two-workers", tiny_model_dir, digits_dataset_dir, iterations=1, pipeline=pipeline)
        state = _run(cfg)
        logs = "\n".join((tmp_path / f"rollout-{n}.log").read_text()[-3000:] for n in "ab")
        assert state.is_completed(), f"{state}\n{logs}"
        layout = layout_for(cfg)
        parts = _part_manifests(layout, 1, 2)
        assert {p.worker for p in parts} == {f"{host}:{w.pid}" for w in workers}  # one part on each worker
        assert [p.prompts for p in parts] == [4, 4]
        merged = RolloutManifest.model_validate(read_stage_record(layout, 1, "rollout"))
        assert merged.part_workers == [p.worker for p in parts]

        reference = small_config(root, "in-process", tiny_model_dir, digits_dataset_dir, iterations=1)
        assert _run(reference).is_completed()
        _assert_same_run(layout, layout_for(reference), iterations=1)

        # Iteration 2: each worker takes one part again; worker b dies at the start of its part.
        longer = small_config(root, "two-workers", tiny_model_dir, digits_dataset_dir, iterations=2, pipeline=pipeline)
        state = _run(longer)
        assert workers[1].wait(timeout=60) == -signal.SIGKILL
        assert state.is_failed(), state
        dead = re.escape(f"worker {host}:{workers[1].pid} is gone")
        named = rf"rollout \(rollout-part-0000([01])-of-00002\) of iteration 2 .*{dead}"
        with pytest.raises(Exception, match=named) as err:
            state.result()
        lost = int(re.search(r"rollout-part-0000([01])", str(err.value)).group(1))

        # Worker b again, and the run again: only the lost part is sampled again; the other comes back from
        # Prefect's cache (its body does not run: it takes no lease, and the submission cleared the old one).
        workers[1] = _start_worker(tmp_path, "rollout-b", ["rollout"])
        _wait_for_task_workers([w.pid for w in workers])
        assert _run(longer).is_completed()
        assert read_lease(layout, 2, part_stage_name(1 - lost, 2)) is None
        # The lost part ran again on a worker, which released its lease when the part ended (issue 56).
        assert read_lease(layout, 2, part_stage_name(lost, 2)) is None
        assert _part_manifests(layout, 2, 2)[lost].worker in {f"{host}:{w.pid}" for w in workers}
        assert _part_manifests(layout, 2, 2)[1 - lost].worker == f"{host}:{workers[0].pid}"
    finally:
        stop_workers(workers)
