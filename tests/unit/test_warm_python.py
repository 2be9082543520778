"""The test zygote (tests/fixtures/warm_python.py, zygote.py): a child it forks is a process of its own that runs the
module it was asked for, as `python -m` would, with torch already imported; a child whose environment differs
in what the imports read starts as a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.fixtures import warm_python

PROBE = """
import json, os, sys, time
print(json.dumps({
    "pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "argv": sys.argv[1:], "orig_argv": sys.orig_argv[1:],
    "probe": os.environ.get("PPOFLOW_PROBE"), "torch_before_main": "torch" in sys.modules, "path0": sys.path[0],
    "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
}), flush=True)
print("to-stderr", file=sys.stderr)
if sys.argv[1] == "wait":
    time.sleep(120)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
sys.exit(int(sys.argv[1]))
"""


def _probe(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    return {**os.environ, "PPOFLOW_PROBE": "set here"}


def test_a_child_runs_the_module_in_a_process_of_its_own_with_its_arguments_environment_and_exit_code(tmp_path):
    env = _probe(tmp_path)
    done = warm_python.run(
        [sys.executable, "-m", "probe", "3", "x y"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    zygotes = [z["proc"].pid for z in warm_python._zygotes.values()]
    assert seen["pid"] != os.getpid() and seen["pid"] not in zygotes and zygotes
    assert seen["torch_before_main"]  # forked with the imports done, not a fresh interpreter
    assert seen["argv"] == ["3", "x y"] and seen["orig_argv"] == ["-m", "probe", "3", "x y"]
    assert seen["cwd"] == str(tmp_path) == seen["path0"]
    assert seen["probe"] == "set here"
    assert done.stderr == "to-stderr\n"

    killed = warm_python.run([sys.executable, "-m", "probe", "kill"], cwd=tmp_path, env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL


def test_a_started_child_can_be_signalled_and_waited_for_in_its_own_session(tmp_path):
    env = _probe(tmp_path)
    log = tmp_path / "child.log"
    with open(log, "w") as out:
        child = warm_python.Popen(
            [sys.executable, "-u", "-m", "probe", "wait"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while "to-stderr" not in log.read_text():
        assert time.monotonic() < deadline and child.poll() is None, log.read_text()
        time.sleep(0.05)
    seen = json.loads(log.read_text().splitlines()[0])
    assert seen["pid"] == child.pid == seen["sid"]  # its own session, as start_new_session gives
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0)  # as subprocess: stop_workers waits with what is left of its deadline, 0 once it ran out
    child.terminate()
    assert child.wait(timeout=60) == -signal.SIGTERM
    assert child.poll() == -signal.SIGTERM


def test_a_child_whose_import_time_environment_differs_gets_a_zygote_that_imported_under_it(tmp_path):
    threads = 2 if os.environ.get("OMP_NUM_THREADS") == "1" else 1  # not this process's: another zygote
    env = {**_probe(tmp_path), "OMP_NUM_THREADS": str(threads)}  # read by torch's OpenMP runtime when it loads
    first = warm_python.run([sys.executable, "-m", "probe", "0"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    seen = json.loads(first.stdout)
    assert seen["torch_before_main"] and seen["threads"] == min(threads, os.cpu_count())  # imported under it
    # a variable read at run time only (PREFECT_, PPOFLOW_, VLLM_, PYTHONPATH) is served by the same zygote
    zygotes = len(warm_python._zygotes)
    env = {**env, "PPOFLOW_ANYTHING": "1", "PREFECT_API_URL": "http://127.0.0.1:9/api", "VLLM_RPC_BASE_PATH": "/x"}
    again = warm_python.run([sys.executable, "-m", "probe", "0"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert json.loads(again.stdout)["threads"] == seen["threads"] and len(warm_python._zygotes) == zygotes
    # a command that is not `python -m` runs as a plain subprocess
    before = len(warm_python.FALLBACKS)
    plain = warm_python.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True)
    assert plain.stdout.strip() == b"False" and len(warm_python.FALLBACKS) == before + 1


PREFECT_PROBE = """
import json, logging, sys
preloaded = "prefect" in sys.modules
from prefect import flow  # what ppoflow's modules import: Prefect's whole import, its logging set-up included
from prefect.settings import get_current_settings
settings = get_current_settings()
def shape(logger):
    return [logger.level, sorted((type(h).__name__, h.level) for h in logger.handlers)]
print(json.dumps({
    "preloaded": preloaded, "api": settings.api.url, "home": str(settings.home),
    "results": str(settings.results.local_storage_path), "level": settings.logging.level,
    "loggers": {name: shape(logging.getLogger(name)) for name in ("", "prefect", "prefect.flow_runs")},
}))
"""


def test_a_child_reads_prefects_settings_from_its_own_environment_and_folder_as_a_fresh_interpreter_does(tmp_path):
    (tmp_path / "prefect_probe.py").write_text(PREFECT_PROBE)
    seen = {}
    for i, (url, level) in enumerate((("http://127.0.0.1:9/api", "DEBUG"), ("http://127.0.0.1:10/api", "ERROR"))):
        env = {
            **os.environ,
            "PREFECT_API_URL": url,
            "PREFECT_HOME": str(tmp_path / f"home-{i}"),
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / f"results-{i}"),
        }
        (tmp_path / "prefect.toml").write_text(f'[logging]\nlevel = "{level}"\n')  # read from the working folder
        argv = [sys.executable, "-m", "prefect_probe"]
        forked = warm_python.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        fresh = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert forked.returncode == 0 == fresh.returncode, forked.stderr[-2000:] + fresh.stderr[-2000:]
        seen[i] = json.loads(forked.stdout)
        assert seen[i]["preloaded"] and not json.loads(fresh.stdout)["preloaded"]
        assert {**seen[i], "preloaded": None} == {**json.loads(fresh.stdout), "preloaded": None}
        assert (seen[i]["api"], seen[i]["home"], seen[i]["level"]) == (url, env["PREFECT_HOME"], level)
    assert seen[0]["loggers"] != seen[1]["loggers"]  # the logging set-up too was redone, not inherited
