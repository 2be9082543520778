"""Warm stage workers: three long-lived `ppoflow worker` processes (rollout, score, update+checkpoint) on the
loopback Prefect server run every stage of a 4-iteration run; each stage's manifest names the worker process
that ran it, and no worker built an engine after the first iteration (engines stay warm). The run learns the
same as in-process: its metrics rows equal an in-process run's (same seeds, same computation)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.pipeline_helpers import small_config
from tests.integration.test_pipeline_pools import _stop_workers

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
WORKERS = {"rollout": ["rollout"], "score": ["score"], "train": ["update", "checkpoint"]}
ITERATIONS = 4


def test_stages_run_on_warm_workers_that_build_each_engine_once(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from engines import warm
    from engines.stages.manifests import STAGE_MANIFESTS
    from flows.records import read_metrics, read_stage_record
    from flows.training import ppo_training
    from storage.layout import layout_for

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    }
    workers = {
        name: subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "worker", *[a for s in stages for a in ("--stage", s)]],
            cwd=REPO,
            env=env,
            stdout=open(tmp_path / f"{name}.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for name, stages in WORKERS.items()
    }
    # eval at the last iteration only (after its rollout): it runs on the rollout worker, which builds the
    # eval prompt set and a scorer then, so the rollout manifests' engine_builds stay constant
    eval_section = {"data_path": _held_out(tmp_path), "every": ITERATIONS}
    try:
        cfg = small_config(
            str(tmp_path / "runs"),
            "warm",
            tiny_model_dir,
            digits_dataset_dir,
            iterations=ITERATIONS,
            pipeline={"stage_workers": ["rollout", "score", "update", "checkpoint"]},
            eval=eval_section,
        )
        state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
        logs = "\n".join((tmp_path / f"{n}.log").read_text()[-3000:] for n in WORKERS)
        assert state.is_completed(), f"{state}\n{logs}"
    finally:
        _stop_workers(list(workers.values()))

    layout = layout_for(cfg)
    host = socket.gethostname()
    for name, stages in WORKERS.items():
        for stage in stages:
            manifests = [
                STAGE_MANIFESTS[stage].model_validate(read_stage_record(layout, i, stage))
                for i in range(1, ITERATIONS + 1)
            ]
            assert {m.worker for m in manifests} == {f"{host}:{workers[name].pid}"}, (stage, manifests)
            builds = [m.engine_builds for m in manifests]
            # Built in iteration 1 (checkpoint builds nothing), never again afterwards.
            assert builds == [builds[0]] * ITERATIONS, (stage, builds)
    assert read_stage_record(layout, 1, "rollout")["engine_builds"] >= 2  # prompt set + sampler
    assert read_stage_record(layout, 1, "update")["engine_builds"] >= 1  # the trainer
    evaluated = STAGE_MANIFESTS["eval"].model_validate(read_stage_record(layout, ITERATIONS, "eval"))
    assert evaluated.worker == f"{host}:{workers['rollout'].pid}"  # eval goes where rollout goes
    assert [read_stage_record(layout, i, "eval") for i in range(1, ITERATIONS)] == [None] * (ITERATIONS - 1)

    # The same run in this process: the same rows (the computation does not depend on where it runs).
    warm.invalidate()
    local = small_config(
        str(tmp_path / "runs"), "in-process", tiny_model_dir, digits_dataset_dir, iterations=ITERATIONS
    ).model_copy(update={"eval": cfg.eval})
    assert ppo_training(config=local.model_dump(mode="json"), return_state=True).is_completed()
    for row, local_row in zip(read_metrics(layout), read_metrics(layout_for(local)), strict=True):
        for key in ("reward/mean", "loss/policy", "loss/value", "kl/mean"):
            assert row[key] == local_row[key], (row["iteration"], key)
    assert row["eval/reward_mean"] == local_row["eval/reward_mean"]  # the last rows: the worker's eval == local


def _held_out(tmp_path) -> str:
    from engines.toy.task import build_digits_dataset

    return str(build_digits_dataset(tmp_path / "held-out", num_rows=6, seed=5))
