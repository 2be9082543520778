"""A reward function that hangs or tries to end the process, with the default thread isolation.

A hang: the call times out with its clear error, the next call (a retried stage) does not wait for the stuck
one, and the process still exits. Before this, the worker was a ThreadPoolExecutor thread, which the
interpreter joins at exit: the script below printed its timeout and then never ended.

An exit: `sys.exit(3)` and `os._exit(7)` in the function are a RewardError naming the source, the function and
the sample, and the process goes on. Before this, the first ended the script with exit code 3 (SystemExit
re-raised in the caller) and the second with code 7 and not a line. Run in a subprocess for that reason.
"""

import os
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import sys, time
    from engines.rewards.base import RewardBatch, RewardError
    from engines.rewards.function import FunctionRewardSource

    source = FunctionRewardSource(sys.argv[1] + ":reward", timeout_s=1.0, name="hangs")
    batch = RewardBatch(prompts=["p"], responses=["r"], prompt_ids=[[1]], response_ids=[[2]], labels=["hang"],
                        sample_ids=["iter 1 prompt 0 sample 0"])
    try:
        source.score(batch)
    except RewardError as e:
        print("ERROR", e, flush=True)
    start = time.monotonic()
    batch.labels = ["ok"]                      # the retry: a fresh worker answers while the first still spins
    print("RETRY", source.score(batch), round(time.monotonic() - start, 2), flush=True)
""")

REWARD = textwrap.dedent("""
    def reward(queries, prompts, labels, **kwargs):
        if labels[0] == "hang":
            while True:          # a busy loop in Python: the worst case, it never sleeps or returns
                pass
        return [1.0]
""")


def test_hung_reward_function_times_out_and_the_process_exits(tmp_path):
    (tmp_path / "hang_reward.py").write_text(REWARD)
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    start = time.monotonic()
    # 60 s bound: start-up (imports) on a loaded 2-core machine plus the 1 s timeout; a hang fails it.
    done = subprocess.run(
        [sys.executable, str(tmp_path / "script.py"), str(tmp_path / "hang_reward.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ERROR reward source 'hangs'") and "timed out after 1.0 s" in lines[0]
    assert "on iter 1 prompt 0 sample 0" in lines[0] and "isolation: process" in lines[0]
    retry = lines[1].split()
    assert retry[:2] == ["RETRY", "[1.0]"] and float(retry[2]) < 1.0, lines[1]
    assert elapsed < 60


EXITS_SCRIPT = textwrap.dedent("""
    import sys
    from engines.rewards.base import RewardBatch, RewardError
    from engines.rewards.function import FunctionRewardSource

    batch = RewardBatch(prompts=["p"], responses=["r"], prompt_ids=[[1]], response_ids=[[2]], labels=["l"],
                        sample_ids=["iter 4 prompt 2 sample 1"])
    for fn in sys.argv[2:]:
        source = FunctionRewardSource(f"{sys.argv[1]}:{fn}", name="code")
        try:
            print("SCORED", fn, source.score(batch), flush=True)
        except RewardError as e:
            print("ERROR", fn, e, flush=True)
    print("STILL RUNNING", flush=True)
""")

EXITS = textwrap.dedent("""
    import os, sys
    from os import _exit          # bound at import: the guard is installed before the module is imported

    def calls_sys_exit(queries, prompts, labels, **kwargs):
        sys.exit(3)

    def calls_os_exit(data_source, solution_str, ground_truth, extra_info=None):
        try:
            os._exit(7)
        except Exception:         # the function's own catch-all must not swallow it either
            return 0.0

    def calls_bound_exit(data_source, solution_str, ground_truth, extra_info=None):
        _exit(8)

    async def awaits_os_exit(data_source, solution_str, ground_truth, extra_info=None):
        os._exit(9)

    def forks(data_source, solution_str, ground_truth, extra_info=None):
        # A child forked from the worker thread exits for real with os._exit, as multiprocessing's do.
        pid = os.fork()
        if pid == 0:
            os._exit(5)
        return float(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
""")


def test_exit_calls_in_a_reward_thread_are_errors_naming_the_call(tmp_path):
    (tmp_path / "exits.py").write_text(EXITS)
    (tmp_path / "script.py").write_text(EXITS_SCRIPT)
    functions = ["calls_sys_exit", "calls_os_exit", "calls_bound_exit", "awaits_os_exit", "forks"]
    done = subprocess.run(
        [sys.executable, str(tmp_path / "script.py"), str(tmp_path / "exits.py"), *functions],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    where = f"reward source 'code' ({tmp_path / 'exits.py'}"
    for line, (fn, call) in zip(
        lines,
        [
            ("calls_sys_exit", "sys.exit(3)"),
            ("calls_os_exit", "os._exit(7)"),
            ("calls_bound_exit", "os._exit(8)"),
            ("awaits_os_exit", "os._exit(9)"),
        ],
    ):
        assert line.startswith(f"ERROR {fn} {where}:{fn}) called {call} on iter 4 prompt 2 sample 1"), line
    assert lines[4] == "SCORED forks [5.0]"  # the forked child's own os._exit(5) ended the child, as it should
    assert lines[5:] == ["STILL RUNNING"]
