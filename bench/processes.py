"""The processes of the multi-process benchmarks (bench/pools.py, bench/async.py), also started by the tests
that run the same set-up: a loopback Prefect server, warm stage workers or process-pool workers, and a
driver process that runs the training flow and prints what it measured as one JSON line.

    with loopback_prefect_server(home) as api_url:
        env = child_env(workdir, api_url)
        data = run_driver("bench.pools", ["--driver", "warm", ...], "warm", workdir, env, tag)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from storage.layout import RunLayout

REPO = Path(__file__).resolve().parent.parent
STAGES = ("rollout", "score", "update", "checkpoint")
# `ppoflow worker` processes of pipeline.stage_workers: group -> the stages it runs. The checkpoint stage (the
# commit: a marker, LATEST and retention, no engine) stays in the flow: on the trainer's worker it cost a
# dispatch round trip on the trainer's path each iteration (bench.async warm k = 1, 16 iterations: 0.644 ->
# 0.695 iterations/s with it in the flow, k = 0 unchanged at 0.44).
WARM_GROUPS = {"rollout": ["rollout"], "score": ["score"], "train": ["update"]}
WARM_STAGES = [stage for stages in WARM_GROUPS.values() for stage in stages]
# prefect.yaml's process work pools, and the stage deployments that pipeline.stage_pools names
POOLS = ["ppoflow-pool", "rollout-pool", "score-pool", "train-pool", "worker-pool"]  # worker-pool: flows/worker_flow.py
POOL_GROUPS = {"rollout-pool": ["rollout"], "score-pool": ["score"], "train-pool": ["update", "checkpoint"]}
STAGE_POOLS = {
    "rollout": "ppo-rollout/ppo-rollout",
    "score": "ppo-score/ppo-score",
    "update": "ppo-update/ppo-update",
    "checkpoint": "ppo-checkpoint/ppo-checkpoint",
}


def variant_sections(variant: str) -> dict[str, dict]:
    """The config sections (bench.overhead.bench_config's `extra`) that run the stages as `variant` says:
    warm (pipeline.stage_workers), pools (pipeline.stage_pools), anything else in-process."""
    if variant == "warm":
        return {"pipeline": {"stage_workers": list(WARM_STAGES)}}
    if variant == "pools":
        return {"pipeline": {"stage_pools": dict(STAGE_POOLS)}}
    return {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def loopback_prefect_server(home: Path) -> Iterator[str]:
    """Run `ppoflow prefect-server` (Prefect's server, adaptations/prefect_server.py) on 127.0.0.1 with its database
    under `home`; yields the API URL and stops the server on exit. RuntimeError (pointing at
    `home`/server.log) when it exits or does not answer /api/health within 180 s."""
    import httpx

    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
        "PREFECT_SERVER_UI_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "prefect-server", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited early; see {home / 'server.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        proc.kill()
        raise RuntimeError(f"prefect server did not answer /api/health in 180 s; see {home / 'server.log'}")
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextmanager
def workdir_with_server(prefix: str) -> Iterator[tuple[str, str]]:
    """A temporary work folder (removed on exit) with a loopback Prefect server whose home is its server/
    folder; yields (work folder, API URL)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        home = Path(workdir, "server")
        home.mkdir()
        with loopback_prefect_server(home) as api_url:
            yield workdir, api_url


def add_driver_arguments(parser: argparse.ArgumentParser, variants: Sequence[str]) -> None:
    """The hidden options with which a bench starts itself as the driver process of `run_driver`."""
    parser.add_argument("--driver", choices=list(variants), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)


def prefect_cli(*args: str, env: dict, timeout_s: float = 300, run=subprocess.run) -> subprocess.CompletedProcess:
    """`prefect ARGS...` run from the repository (where prefect.yaml is), output captured; timeout_s at most. `run`
    starts it (the tests pass tests/fixtures/warm_python.run)."""
    return run(
        [sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def create_process_pools(names: Sequence[str], api_url: str) -> None:
    """Process work pools `names` at the server at `api_url`, with the base job template of Prefect's process worker:
    what `prefect work-pool create NAME --type process` makes, without a process per pool. A pool that exists is
    left as it is (the CLI refuses it the same way, unless --overwrite)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        for name in names:
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
            except ObjectAlreadyExists:
                pass


def child_env(workdir: str, api_url: str) -> dict:
    """Environment of every process of a variant: one server, one result store, no inherited rendezvous
    (MASTER_PORT may still be bound by a trainer of the parent process)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    }
    env.update(
        {
            "PREFECT_API_URL": api_url,
            "PREFECT_HOME": os.path.join(workdir, "prefect-home"),
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": os.path.join(workdir, "prefect-results"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
            "DS_ACCELERATOR": "cpu",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def start_workers(variant: str, workdir: str, env: dict, tag: str) -> dict[str, subprocess.Popen]:
    """The long-lived processes of `variant`: stage workers (warm), process pool workers (pools), none
    (anything else). Each logs to `workdir`/<tag>-<group>.log and leads its own process group."""
    if variant == "warm":
        cmds = {g: ["-m", "cli", "worker", *[a for s in st for a in ("--stage", s)]] for g, st in WARM_GROUPS.items()}
    elif variant == "pools":
        cmds = {
            p: ["-m", "prefect", "worker", "start", "--pool", p, "--type", "process", "--limit", "1"]
            for p in POOL_GROUPS
        }
    else:
        return {}
    return {
        group: subprocess.Popen(
            [sys.executable, *cmd],
            cwd=REPO,
            env=env,
            stdout=open(os.path.join(workdir, f"{tag}-{group}.log"), "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for group, cmd in cmds.items()
    }


def stop_workers(workers: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every worker, then SIGKILL the process group of any still running after one shared grace
    period. (A Prefect process worker answers SIGTERM by forwarding SIGINT to itself and can take tens of
    seconds to exit; its flow runs have all finished by now, so nothing is lost.)"""
    for w in workers:
        w.terminate()
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(w.pid, signal.SIGKILL)  # start_new_session=True: the group is the worker's own
            w.wait()


def run_driver(module: str, args: Sequence[str], variant: str, workdir: str, env: dict, tag: str) -> dict:
    """Start `variant`'s workers, run `python -m module ARGS` (a driver that prints one line starting with
    {"driver"), stop the workers. Returns that line's JSON plus t0 (unix time before the workers started)
    and the workers' pids; RuntimeError with the driver's stderr and the workers' logs when it fails."""
    t0 = time.time()
    workers = start_workers(variant, workdir, env, tag)
    try:
        out = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True)
    finally:
        stop_workers(list(workers.values()))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('{"driver"')]
    if out.returncode != 0 or not lines:
        logs = "".join(Path(workdir, f"{tag}-{g}.log").read_text()[-1500:] for g in workers)
        raise RuntimeError(f"{tag} failed (rc {out.returncode}):\n{out.stderr[-4000:]}\n--- workers ---\n{logs}")
    return {**json.loads(lines[-1]), "t0": t0, "pids": {g: w.pid for g, w in workers.items()}}


def train_in_driver(cfg, keep: Sequence[str]) -> tuple["RunLayout", list[dict]]:
    """In a driver process: run the training flow on `cfg`; returns its run layout and, per iteration, the
    metrics row's `keep` keys."""
    from adaptations import install_process_adaptations
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.layout import layout_for

    install_process_adaptations()  # as `ppoflow train` does, before Prefect starts its temporary server
    ppo_training(cfg.model_dump(mode="json"))
    layout = layout_for(cfg)
    return layout, [{key: row[key] for key in keep} for row in read_metrics(layout)]
