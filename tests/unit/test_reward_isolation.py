"""Function rewards in a worker process (reward.sources[].isolation = "process"): the same rewards as in a
thread, the same errors, and a call that hangs is stopped for good (the worker is killed, the next call gets
a new one), which a thread cannot do."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from engines.rewards.base import RewardBatch, RewardError
from engines.rewards.function import FunctionRewardSource

REWARDS = textwrap.dedent("""
    import os, signal, sys, time

    def exact(data_source, solution_str, ground_truth, extra_info=None):
        print("printing must not break the protocol")
        return {"score": 1.0} if solution_str == ground_truth else 0.25

    def lengths(queries, prompts, labels, **kwargs):
        import numpy as np
        return {"rewards": np.array([len(q) - len(p) for q, p in zip(queries, prompts)], dtype=np.float64)}

    def spins(data_source, solution_str, ground_truth, extra_info=None):
        # a generated program that never ends, unless told otherwise
        if solution_str == "loop":
            with open(ground_truth, "w") as f:
                f.write(str(os.getpid()))
            while True:
                pass
        return float(os.getpid())

    def raises(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError("no such test case")

    def exits(data_source, solution_str, ground_truth, extra_info=None):
        os._exit(3)

    def calls_sys_exit(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "exit":
            sys.exit(4)
        return float(os.getpid())

    def crashes(data_source, solution_str, ground_truth, extra_info=None):
        import ctypes
        ctypes.string_at(0)  # reads address 0: a segfault in native code

    def killed(data_source, solution_str, ground_truth, extra_info=None):
        os.kill(os.getpid(), signal.SIGKILL)

    async def awaits(data_source, solution_str, ground_truth, extra_info=None):
        return 2.0
""")


@pytest.fixture()
def rewards(tmp_path):
    path = tmp_path / "code_rewards.py"
    path.write_text(REWARDS)
    return path


def _batch(responses, labels):
    n = len(responses)
    return RewardBatch(
        prompts=["q: "] * n,
        responses=list(responses),
        prompt_ids=[[1]] * n,
        response_ids=[[2]] * n,
        labels=list(labels),
        data_sources=["code"] * n,
        sample_ids=[f"iter 1 prompt {i} sample 0" for i in range(n)],
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child that its parent has not reaped yet is a zombie: not running
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("fn", ["exact", "lengths", "awaits"])
def test_process_isolation_scores_like_a_thread(rewards, fn):
    batch = _batch(["42", "41", "a longer answer"], ["42", "42", "x"])
    in_thread = FunctionRewardSource(f"{rewards}:{fn}", batch_size=2).score(batch)
    in_process = FunctionRewardSource(f"{rewards}:{fn}", batch_size=2, isolation="process").score(batch)
    assert in_process == in_thread
    expected = {"exact": [1.0, 0.25, 0.25], "lengths": [2.0, 2.0, 15.0], "awaits": [2.0, 2.0, 2.0]}[fn]
    assert in_process == expected  # by hand from the functions above


def test_a_hanging_call_is_killed_and_the_next_call_gets_a_new_worker(rewards, tmp_path):
    source = FunctionRewardSource(f"{rewards}:spins", timeout_s=1.0, isolation="process")
    first_worker = int(source.score(_batch(["fine"], [""]))[0])  # the function returns its worker's pid
    assert first_worker != os.getpid() and _alive(first_worker)
    pid_file = tmp_path / "spinning.pid"
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"timed out after 1.0 s on iter 1 prompt 0 sample 0"):
        source.score(_batch(["loop"], [str(pid_file)]))
    assert time.monotonic() - started < 30
    assert int(pid_file.read_text()) == first_worker  # the spinning call ran in that worker ...
    assert not _alive(first_worker)  # ... and it is gone, not spinning on
    second_worker = int(source.score(_batch(["fine"], [""]))[0])
    assert second_worker not in (first_worker, os.getpid()) and _alive(second_worker)
    source.close()
    assert not _alive(second_worker)


def test_errors_name_the_source_and_the_sample(rewards):
    with pytest.raises(RewardError, match=r"'code' .* raised KeyError: 'no such test case' on iter 1 prompt 0"):
        FunctionRewardSource(f"{rewards}:raises", name="code", isolation="process").score(_batch(["a"], ["b"]))
    with pytest.raises(RewardError, match=r"exited with code 3 during the call on iter 1 prompt 0 sample 0"):
        FunctionRewardSource(f"{rewards}:exits", isolation="process").score(_batch(["a"], ["b"]))
    with pytest.raises(ValueError, match="isolation must be 'thread' or 'process'"):
        FunctionRewardSource(f"{rewards}:exact", isolation="fork")


@pytest.mark.parametrize(
    "fn, how",
    [
        ("exits", "exited with code 3"),  # os._exit(3)
        ("crashes", "was killed by signal SIGSEGV (11)"),
        ("killed", "was killed by signal SIGKILL (9)"),
    ],
)
def test_a_worker_that_dies_is_named_with_how(rewards, fn, how):
    # Before: "died during the call (exit code N)", and a worker still exiting was killed by us first (-9).
    source = FunctionRewardSource(f"{rewards}:{fn}", name="code", isolation="process")
    with pytest.raises(RewardError) as err:
        source.score(_batch(["a"], ["b"]))
    message = str(err.value)
    assert message.startswith(f"reward source 'code' ({rewards}:{fn}): the reward worker ")
    assert message.endswith(f" {how} during the call on iter 1 prompt 0 sample 0")


def test_sys_exit_in_the_worker_is_an_error_and_the_worker_serves_on(rewards):
    source = FunctionRewardSource(f"{rewards}:calls_sys_exit", name="code", isolation="process")
    worker = int(source.score(_batch(["fine"], [""]))[0])
    with pytest.raises(RewardError) as err:
        source.score(_batch(["fine", "exit"], ["", ""]))
    assert (
        str(err.value)
        == f"reward source 'code' ({rewards}:calls_sys_exit) called sys.exit(4) on iter 1 prompt 1 sample 0"
    )
    assert int(source.score(_batch(["fine"], [""]))[0]) == worker  # the same worker answers the next call
    source.close()


def test_the_config_setting_reaches_the_source(rewards):
    from engines.scoring.scorer import build_reward_sources
    from ppoflow.config import build_config

    cfg = build_config(
        {
            "reward": {
                "sources": [{"kind": "function", "target": f"{rewards}:spins", "isolation": "process", "name": "code"}]
            }
        },
        "test",
    )
    (source,) = build_reward_sources(cfg)
    assert source.isolation == "process"
    assert int(source.score(_batch(["fine"], [""]))[0]) != os.getpid()  # scored in another process
    source.close()
