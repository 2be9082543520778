"""Shared fixtures live in tests/fixtures/, one file per real component (models, S3 server, Prefect server)."""

import atexit
import os
import shutil
import tempfile

# Torch threads per test process: the cores shared among `make test`'s pytest-xdist processes (one each on the 2-core
# CI machine). More threads than cores in all makes libgomp sleep at its barriers and every small op pays a wake-up
# (runtime/workers.py); the children a test starts (runs, workers, torchrun ranks) inherit it.
_TEST_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // _TEST_PROCESSES)))
# vLLM's engine cores likewise: each test process's on its own share of the cores (unset, ppoflow binds an engine to
# every core: engines/rollout/vllm_process.bind_all_cpus; vLLM's own default put both processes' engines on core 0).
if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and hasattr(os, "sched_getaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    _share = max(1, len(_cpus) // _TEST_PROCESSES)
    _index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % max(1, len(_cpus) // _share)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, _cpus[_index * _share : (_index + 1) * _share]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# The Prefect workers and `ppoflow serve` runners the tests start look for scheduled flow runs every second, not every
# 10 s (Prefect's defaults): a pool's stage or a served retry is picked up at once instead of at the next poll, which
# left a core idle for ~5 s per pickup (test_pipeline_pools: 96 s -> 65 s). What runs once picked up is unchanged.
os.environ.setdefault("PREFECT_WORKER_QUERY_SECONDS", "1")
os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Copies of remote checkpoints go to a folder of this test session's (workers it starts inherit it), not
# into the user's ~/.cache/ppoflow.
if "PPOFLOW_CACHE" not in os.environ:
    os.environ["PPOFLOW_CACHE"] = tempfile.mkdtemp(prefix="ppoflow-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PPOFLOW_CACHE"], True)

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.s3",
    "tests.fixtures.prefect_server",
]


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_warm_score_cache_across_tests():
    """The score stage keeps its ScoreCache warm in the process (stages/held.py), holding what it has read.
    Tests reuse bucket and folder names on a reset server, so a cache kept from an earlier test would answer
    from entries that this test's storage never held: each test starts without one."""
    yield
    from engines import warm

    warm.invalidate(warm.Role.SCORE_CACHE)


def pytest_collection_finish(session):
    """Tests that run flows in this process get the adaptations the `ppoflow` command installs (adaptations/), as
    every entry point does: without them each SQLite lock conflict of Prefect's temporary server is a 2 s wait.
    Only when a collected test module imported Prefect, so a run of pure unit tests does not pay its import."""
    import sys

    if "prefect" in sys.modules:
        from adaptations import install_process_adaptations

        install_process_adaptations()
