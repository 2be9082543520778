"""vLLM's CPU engine core gets every CPU of the calling process (engines/rollout/vllm_process.bind_all_cpus says why),
as vLLM itself reads and parses the variable; a value the user set stands. In child processes: the variable is
process-wide and the test session sets its own (tests/conftest.py)."""

import os
import subprocess
import sys

READ_BACK = (
    "import vllm.envs as envs; from engines.rollout.vllm_process import bind_all_cpus; bind_all_cpus(); "
    "from vllm.utils.cpu_resource_utils import parse_id_list; value = envs.VLLM_CPU_OMP_THREADS_BIND; "
    "print(sorted(parse_id_list(value)) if value[0].isdigit() else value)"
)


def _read_back(**env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    done = subprocess.run(
        [sys.executable, "-c", READ_BACK], env={**base, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_unset_the_engine_core_is_bound_to_every_cpu_of_this_process():
    assert _read_back() == str(sorted(os.sched_getaffinity(0)))


def test_a_binding_the_user_chose_stands():
    assert _read_back(VLLM_CPU_OMP_THREADS_BIND="auto") == "auto"
    assert _read_back(VLLM_CPU_OMP_THREADS_BIND="0") == "[0]"
