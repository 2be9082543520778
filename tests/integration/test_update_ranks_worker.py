"""train.num_ranks=2 on a warm `ppoflow worker --stage update --stage checkpoint`: the rank group lives with that
worker process (its rank 0 runs the stage in a task thread) and is started once for the whole run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.processes import stop_workers
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 2


def test_the_rank_group_lives_with_the_warm_update_worker(prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir):
    from flows.records import read_stage_record
    from flows.training import ppo_training
    from stages.manifests import UpdateManifest
    from storage.layout import layout_for

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1")
    log = tmp_path / "train-worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "worker", "--stage", "update", "--stage", "checkpoint"],
        cwd=REPO,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # stop_workers kills the process group: the worker and its ranks
    )
    try:
        cfg = small_config(
            str(tmp_path / "runs"),
            "ranks-on-worker",
            tiny_model_dir,
            digits_dataset_dir,
            iterations=ITERATIONS,
            train={"num_ranks": 2},
            pipeline={"stage_workers": ["update", "checkpoint"]},
        )
        state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
        assert state.is_completed(), f"{state}\n{log.read_text()[-4000:]}"
    finally:
        stop_workers([worker])
    layout = layout_for(cfg)
    updates = [UpdateManifest.model_validate(read_stage_record(layout, i, "update")) for i in (1, 2)]
    assert {u.worker for u in updates} == {f"{socket.gethostname()}:{worker.pid}"}
    assert [u.metrics["ranks/world_size"] for u in updates] == [2.0, 2.0]
    # one group for the run: started by the first update, still the worker's only one at the second
    assert [u.metrics["ranks/group_starts"] for u in updates] == [1.0, 1.0]
    assert updates[0].engine_builds == updates[1].engine_builds  # the trainer was not built again either
