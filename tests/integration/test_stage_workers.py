"""Warm stage workers: three long-lived `ppoflow worker` processes (rollout, score, update+checkpoint) on the
loopback Prefect server run every stage of a 4-iteration run with max_staleness k = 0 and another with k = 1.

What must hold, from the design rather than from the code's output:
- each stage's manifest names the worker process serving that stage, and no worker built an engine after
  its first iteration of a run (the engines stay warm; the rollout engine and the scorer also across runs);
- with k = 1 the staleness of iteration i is min(1, i-1) (the fixed schedule);
- the k = 0 run's rows equal an in-process run's (the computation does not depend on where it runs);
- a reader follows ppo_iteration into each stage function on a warm worker in 6 of ppoflow's frames, as in-process
  (tests/integration/test_stage_frames.py): 3 in the flow's process to the submission (ppo_iteration,
  WarmWorkers.run, submit_to_worker), 3 in the worker's from the task's body (_<stage>, _in_stage, run_<stage>);
  recorded by tests/fixtures/stack_cli.py;
- each worker process runs every stage body on one thread (torch's OpenMP teams: runtime/workers.py);
- a run with train.num_ranks=2 sent to the plain update worker fails naming the torchrun command to start instead;
- killing the update worker with SIGKILL in the middle of iteration 3's update (k = 1) fails the flow run
  with a message naming the dead worker, instead of waiting for it forever; after the worker is started
  again, `prefect flow-run retry` (the README's command) resumes the run and its final checkpoint and
  metrics rows equal the uninterrupted k = 1 run's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.processes import stop_workers
from tests.fixtures import warm_python
from tests.fixtures.warm_python import prefect_cli
from tests.integration.pipeline_helpers import small_config
from tests.integration.test_pipeline_crash import COMPARED, _digests

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
WORKERS = {"rollout": ["rollout"], "score": ["score"], "train": ["update", "checkpoint"]}
ALL_STAGES = ["rollout", "score", "update", "checkpoint"]
# 4: the fewest that hold the k = 1 kill's scene (iteration 3's update killed while iteration 4's rollout and score are
# in flight) and a resume whose iterations (3 and 4) both run in flight together; each more cost ~4 s per run, x4 runs.
ITERATIONS = 4
WORKER_FRAMES = 6  # ppo_iteration to a stage function on a warm worker (the docstring lists them)
_DISTRIBUTED_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}


def _start_worker(
    tmp_path: Path, name: str, stages: list[str], kill: str | None = None, stacks: Path | None = None
) -> subprocess.Popen:
    """`ppoflow worker --stage ...`; with `kill` (a tests/fixtures/kill_cli spec) it SIGKILLs itself then; with
    `stacks`, each stage function call appends its stack there (tests/fixtures/stack_cli.py)."""
    entry = ["cli"]
    if kill is not None:
        entry = ["tests.fixtures.kill_cli", kill]
    elif stacks is not None:
        entry = ["tests.fixtures.stack_cli", str(stacks)]
    return warm_python.Popen(
        [sys.executable, "-m", *entry, "worker", *[a for s in stages for a in ("--stage", s)]],
        cwd=REPO,
        env=_env(),
        stdout=open(tmp_path / f"{name}.log", "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _worker_config(tmp_path, name, model_dir, data_dir, k, iterations=ITERATIONS):
    pipeline = {"stage_workers": ALL_STAGES, "max_staleness": k}
    # k = 1 runs evaluate at their last iteration, after their last rollout: the eval goes to the rollout worker
    sections = {"eval": {"data_path": _held_out(tmp_path), "every": iterations}} if k else {}
    return small_config(
        str(tmp_path / "runs"), name, model_dir, data_dir, iterations=iterations, pipeline=pipeline, **sections
    )


def _held_out(tmp_path) -> str:
    from engines.toy.task import build_digits_dataset

    return str(build_digits_dataset(tmp_path / "held-out", num_rows=6, seed=5))


def _manifests(layout, stage: str, iterations: int):
    from stages.manifests import STAGE_MANIFESTS
    from storage.stage_records import read_stage_record

    return [
        STAGE_MANIFESTS[stage].model_validate(read_stage_record(layout, i, stage)) for i in range(1, iterations + 1)
    ]


def _frames_to_stage_functions(stacks: Path, submitted: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each stage's chain of ppoflow frames: the flow's, to the submission, then the worker's, from the task body."""
    import traceback

    from tests.fixtures.stack_cli import STAGE_FUNCTIONS
    from tests.integration.test_stage_frames import ppoflow_frames

    chains = {}
    for line in stacks.read_text().splitlines():
        entry = json.loads(line)
        stage, (module, name) = entry["stage"], STAGE_FUNCTIONS[entry["stage"]]
        stack = [traceback.FrameSummary(file, 0, function) for file, function in entry["stack"]]
        worker_side = ppoflow_frames(stack, start=f"_{stage}") + [f"{module.replace('.', '/')}.py:{name}"]
        chains[stage] = submitted[stage] + worker_side
    return chains


def test_warm_workers_run_k0_and_k1_and_a_killed_update_worker_resumes_exactly(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    import traceback

    import runtime.executors
    from engines import warm
    from flows.records import read_metrics
    from flows.training import ppo_training
    from stages.manifests import EvalManifest
    from storage.layout import layout_for
    from storage.stage_records import read_stage_record
    from tests.integration.test_stage_frames import ppoflow_frames

    stacks = tmp_path / "stacks.jsonl"
    workers = {name: _start_worker(tmp_path, name, stages, stacks=stacks) for name, stages in WORKERS.items()}
    host = socket.gethostname()
    submitted: dict[str, list[str]] = {}
    submit = runtime.executors.submit_to_worker

    def spy(cfg, stage, *args, **kwargs):
        submitted[stage] = ppoflow_frames(traceback.extract_stack()[:-1]) + ["runtime/stage_runs.py:submit_to_worker"]
        return submit(cfg, stage, *args, **kwargs)

    try:
        configs = {}
        for k in (0, 1):
            cfg = configs[k] = _worker_config(tmp_path, f"warm-k{k}", tiny_model_dir, digits_dataset_dir, k)
            with monkeypatch.context() as patched:  # k = 0: the flow's side of each stage's chain of frames
                if k == 0:
                    patched.setattr(runtime.executors, "submit_to_worker", spy)
                state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
            if k == 0:
                chains = _frames_to_stage_functions(stacks, submitted)
                assert sorted(chains) == sorted(ALL_STAGES), chains
                for stage, chain in chains.items():
                    assert chain == [
                        "flows/iteration.py:ppo_iteration",
                        "runtime/executors.py:run",
                        "runtime/stage_runs.py:submit_to_worker",
                        f"tasks/stage_tasks.py:_{stage}",
                        "tasks/stage_tasks.py:_in_stage",
                        chain[-1],
                    ], (stage, chain)
                    assert len(chain) == WORKER_FRAMES, (stage, chain)
            logs = "\n".join((tmp_path / f"{n}.log").read_text()[-3000:] for n in WORKERS)
            assert state.is_completed(), f"{state}\n{logs}"
            layout = layout_for(cfg)
            for name, stages in WORKERS.items():
                for stage in stages:
                    manifests = _manifests(layout, stage, ITERATIONS)
                    assert {m.worker for m in manifests} == {f"{host}:{workers[name].pid}"}, (k, stage)
                    builds = [m.engine_builds for m in manifests]
                    # Built in the run's first iteration at most (checkpoint builds nothing), never again.
                    assert builds == [builds[0]] * ITERATIONS, (k, stage, builds)
            rows = read_metrics(layout)
            assert [r["async/staleness"] for r in rows] == [min(k, i - 1) for i in range(1, ITERATIONS + 1)]
        # every stage body a worker process ran, in both runs (2 x ITERATIONS iterations, an eval), on one thread of it
        threads: dict[int, set[int]] = {}
        for entry in map(json.loads, stacks.read_text().splitlines()):
            threads.setdefault(entry["pid"], set()).add(entry["thread"])
        assert sorted(threads) == sorted(w.pid for w in workers.values()), threads
        assert all(len(ids) == 1 for ids in threads.values()), threads
        first, second = (layout_for(configs[k]) for k in (0, 1))
        evaluated = EvalManifest.model_validate(read_stage_record(second, ITERATIONS, "eval"))
        assert evaluated.worker == f"{host}:{workers['rollout'].pid}"  # eval goes where rollout goes

        # A run with train.num_ranks=2 on the plain update worker (no torchrun started it): its update is refused by
        # name, with the command that starts a group of 2, and the worker serves on (the runs below).
        pipeline = {"stage_workers": ALL_STAGES}
        two = small_config(
            str(tmp_path / "runs"), "two-ranks", tiny_model_dir, digits_dataset_dir, 1, train={"num_ranks": 2},
            pipeline=pipeline,
        )  # fmt: skip
        state = ppo_training(config=two.model_dump(mode="json"), return_state=True)
        assert state.is_failed(), state
        assert "train.num_ranks=2: the update runs on a torchrun group of 2 ranks" in state.message, state.message
        assert "torchrun --nproc-per-node=2 --no-python ppoflow worker --stage update" in state.message, state.message

        # Issue 40: the same run name under another root, then the first run deleted and started again. The warm
        # workers persist results in Prefect's shared storage; keyed by name, iteration and inputs alone, these
        # runs were answered warm-k0's results ("cannot commit iteration 1: nothing staged"). Keyed by the run's
        # id (run.json), each computes its own.
        import shutil

        elsewhere = _worker_config(tmp_path / "elsewhere", "warm-k0", tiny_model_dir, digits_dataset_dir, 0, 2)
        layout = layout_for(elsewhere)
        assert layout.run_dir != first.run_dir
        for attempt in ("under another root", "deleted and started again"):
            if attempt == "deleted and started again":
                shutil.rmtree(layout.run_dir)
            state = ppo_training(config=elsewhere.model_dump(mode="json"), return_state=True)
            assert state.is_completed(), (attempt, state)
            assert [r["iteration"] for r in read_metrics(layout)] == [1, 2], attempt
            assert all(m.uri.startswith(layout.url(layout.run_dir)) for m in _manifests(layout, "rollout", 2))
        # ... and `runs repair` on warm workers: checkpoint 2 corrupt, quarantined, recomputed to the same bytes (the
        # workers' results of iteration 2 are disowned; before, "cannot commit iteration 2: nothing staged")
        from cli.repair import repair_run

        second_ckpt = Path(layout.checkpoint_dir(2))
        sound = _digests(second_ckpt)
        weights = second_ckpt / "policy" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-100] ^= 0xFF  # one flipped byte in the weights
        weights.write_bytes(bytes(data))
        assert "is corrupt" in repair_run(str(tmp_path / "elsewhere" / "runs"), "warm-k0")
        state = ppo_training(config=elsewhere.model_dump(mode="json"), return_state=True)
        assert state.is_completed(), ("after repair", state)
        assert _digests(second_ckpt) == sound

        # The rollout engine (prompt set + sampler) and the scorer were built once, in the k = 0 run's iteration
        # 1; the k = 1 run reused them (the sampler loaded its weights in place). The trainer is rebuilt once per
        # run: it holds one run's optimizer state.
        assert _manifests(first, "rollout", 1)[0].engine_builds >= 2
        assert _manifests(second, "rollout", 1)[0].engine_builds == _manifests(first, "rollout", 1)[0].engine_builds
        assert _manifests(second, "score", 1)[0].engine_builds == _manifests(first, "score", 1)[0].engine_builds
        assert _manifests(second, "update", 1)[0].engine_builds == _manifests(first, "update", 1)[0].engine_builds + 1

        # SIGKILL the update worker at its 3rd update of the next run (iteration 3; iteration 4's rollout and
        # score are in flight on the other workers meanwhile).
        stop_workers([workers.pop("train")])
        killer = _start_worker(tmp_path, "train", WORKERS["train"], kill="stages.update:train_on@3")
        killed = _worker_config(tmp_path, "warm-k1-killed", tiny_model_dir, digits_dataset_dir, 1)
        state = ppo_training(config=killed.model_dump(mode="json"), return_state=True)
        assert killer.wait(timeout=60) == -signal.SIGKILL
        assert state.is_failed(), state
        with pytest.raises(Exception, match=rf"worker {host}:{killer.pid} is gone"):
            state.result()
        assert read_metrics(layout_for(killed))[-1]["iteration"] == 2

        workers["train"] = _start_worker(tmp_path, "train", WORKERS["train"])
        flow_run_id = str(state.state_details.flow_run_id)
        entrypoint = ["--entrypoint", "flows/training.py:ppo_training"]
        retry = prefect_cli("flow-run", "retry", flow_run_id, *entrypoint, env=_env(), timeout_s=600)
        assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    finally:
        stop_workers(list(workers.values()))

    resumed = layout_for(killed)
    assert _digests(Path(resumed.checkpoint_dir(ITERATIONS))) == _digests(Path(second.checkpoint_dir(ITERATIONS)))
    rows, clean_rows = read_metrics(resumed), read_metrics(second)
    assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
    for row, clean_row in zip(rows, clean_rows, strict=True):
        for key in (*COMPARED, "async/staleness"):
            assert row[key] == clean_row[key], (row["iteration"], key)

    # The k = 0 run in this process: the same rows.
    warm.invalidate()
    local = small_config(str(tmp_path / "runs"), "in-process", tiny_model_dir, digits_dataset_dir, iterations=3)
    assert ppo_training(config=local.model_dump(mode="json"), return_state=True).is_completed()
    for row, local_row in zip(read_metrics(first)[:3], read_metrics(layout_for(local)), strict=True):
        for key in ("reward/mean", "loss/policy", "loss/value", "kl/mean"):
            assert row[key] == local_row[key], (row["iteration"], key)


def _held_out(tmp_path) -> str:
    from engines.toy.task import build_digits_dataset

    return str(build_digits_dataset(tmp_path / "held-out", num_rows=6, seed=5))
