"""Tool calls in a sealed worker: a hang, a crash, a memory hog and a connection attempt each become an
observation naming the call, never a stuck or crashed run; the calculator and the arithmetic task on top."""

from __future__ import annotations

import socket
import time

import pytest

from engines.environments.arithmetic import CalculatorArithmetic, make_rows
from engines.environments.calculator import evaluate
from engines.environments.checked import CheckedEnvironment, EnvironmentFailed
from engines.environments.loader import load_environment_factory
from engines.environments.tools import SandboxedTool, ToolLimits, ToolUnavailable
from tests.fixtures import environments as fixtures

F = "tests.fixtures.environments"


def _tool(name: str, timeout_s: float = 5.0, memory_mb: int = 64) -> SandboxedTool:
    return SandboxedTool(f"{F}:{name}", name, ToolLimits(timeout_s, memory_mb))


def test_a_hanging_tool_is_killed_and_the_next_call_gets_a_fresh_worker():
    spin = _tool("spin", timeout_s=0.5)
    start = time.monotonic()
    result = spin.call("x")
    assert time.monotonic() - start < 5
    assert result.error == "spin('x') timed out after 0.5 s; its worker was killed"
    assert result.text == "Error: " + result.error
    pid = _tool("pid", timeout_s=0.5)  # the same limits but another spec: its own worker
    assert isinstance(int(pid.call().text), int)


def test_a_crashing_tool_is_an_observation():
    result = _tool("segfault").call(0)
    assert result.error.startswith("segfault(0) crashed: its worker ") and "SIGSEGV" in result.error
    assert _tool("allocate").call(1).text == "1"  # other tools go on


def test_memory_beyond_the_limit_raises_memory_error_in_the_tool():
    tool = _tool("allocate", memory_mb=64)
    assert tool.call(16).text == "16"
    assert tool.call(512).error == "allocate(512) raised MemoryError: "
    assert tool.call(16).text == "16"  # the worker survives its tool's MemoryError


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


def test_no_network_not_even_for_a_child_process(listener):
    # Control: the same functions reach the port when called here, so a failure below is the sandbox's doing.
    assert fixtures.connect_here(listener) == "connected"
    assert fixtures.connect_from_child(listener) == "connected"
    assert (
        _tool("connect_here")
        .call(listener)
        .error.startswith(f"connect_here({listener}) raised PermissionError: network access is off for tools")
    )
    tool = _tool("connect_from_child")
    if tool.sealing != "network namespace":
        pytest.skip("this kernel refuses network namespaces: only the audit hook (above) seals the worker")
    assert "connected" not in tool.call(listener).text
    assert _tool("interfaces").call().text == "['lo']"


def test_a_tool_that_cannot_be_loaded_is_a_configuration_error():
    with pytest.raises(ToolUnavailable, match=r"tool 'tests.fixtures.environments:nothing': AttributeError: tool"):
        _tool("nothing").call(1)


@pytest.mark.parametrize(
    "expression, value",
    [("347 * 29", "10063"), ("(2 + 3) / 4", "1.25"), ("-7 // 2", "-4"), ("2 ** 10 % 1000", "24"), ("6 / 3", "2")],
)
def test_calculator(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "x + 1", "'a' * 3", "1 +"])
def test_calculator_refuses_what_is_not_arithmetic(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def _episode(replies: list[str], row: dict) -> list:
    env = CheckedEnvironment.start(load_environment_factory("engines.environments.arithmetic:CalculatorArithmetic"), 0)
    assert env.reset(row) is None
    messages, observations = [{"role": "user", "content": row["prompt"]}], []
    for reply in replies:
        messages.append({"role": "assistant", "content": reply})
        observations.append(env.step(messages))
        if observations[-1].done:
            break
        messages.append({"role": observations[-1].role, "content": observations[-1].text})
    env.close()
    return observations


def test_arithmetic_rewards_the_calculators_answer():
    row = make_rows(1, seed=3)[0]
    a, b = row["prompt"].split("What is ")[1].split("?")[0].split(" * ")
    product = str(int(a) * int(b))  # by hand, not by the calculator
    assert row["label"] == product
    used = _episode([f"<calc>{a} * {b}</calc>", f"The answer is {product}."], row)
    assert [(o.role, o.text, o.reward, o.done) for o in used] == [
        ("tool", product, 0.0, False),
        ("user", "", 1.0, True),
    ]
    assert used[0].info == {"tool": "calc"}
    assert used[1].info == {"tool_calls": 1, "is_success": True}  # success_reward 1.0: the right product
    wrong = _episode([str(int(product) + 1)], row)[0]
    assert (wrong.reward, wrong.info["is_success"]) == (0.0, False)


def test_arithmetic_tool_errors_come_back_and_calls_are_bounded():
    row = make_rows(1, seed=3)[0]
    observations = _episode(["<calc>9 ** 9 ** 9 ** 9</calc>"] + ["<calc>1 / 0</calc>"] * 5, row)
    # Which limit stops it first depends on the machine's speed; either way the sandbox, not the run, pays.
    stopped = observations[0].info["tool_error"]
    assert stopped.startswith("calculator('9 ** 9 ** 9 ** 9') ")
    assert stopped.endswith("timed out after 5.0 s; its worker was killed") or "raised MemoryError" in stopped
    assert observations[1].text == "Error: calculator('1 / 0') raised ZeroDivisionError: division by zero"
    assert [o.done for o in observations] == [False, False, False, True]
    assert observations[-1].info == {"stopped": "max_tool_calls", "tool_calls": 3}


def test_arithmetic_rows_are_deterministic_and_need_a_label():
    assert make_rows(4, seed=1) == make_rows(4, seed=1) != make_rows(4, seed=2)
    env = CheckedEnvironment.start(load_environment_factory("engines.environments.arithmetic:CalculatorArithmetic"), 5)
    with pytest.raises(EnvironmentFailed, match=r"\(row 5\) reset: raised ValueError: the row's label must be"):
        env.reset({"prompt": "What is 2 * 3?"})
    assert isinstance(CalculatorArithmetic(), CalculatorArithmetic)


def test_a_worker_outlives_the_episode_thread_that_first_called_it():
    # CheckedEnvironment runs each environment on a thread that ends with its episode; a worker dies with the
    # thread that started it (PR_SET_PDEATHSIG), so a worker started from there would die with that episode.
    import threading

    tool = _tool("pid", memory_mb=63)  # limits no other test uses: a worker of its own, started below
    first: list[str] = []
    episode = threading.Thread(target=lambda: first.append(tool.call().text))
    episode.start()
    episode.join()
    time.sleep(0.3)  # a death signal would have arrived by now
    assert tool.call().text == first[0]
