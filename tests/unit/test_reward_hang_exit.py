"""A reward function that hangs, with the default thread isolation: the call times out with its clear error,
the next call (a retried stage) does not wait for the stuck one, and the process still exits.

Before this, the worker was a ThreadPoolExecutor thread, which the interpreter joins at exit: the script
below printed its timeout and then never ended.
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
