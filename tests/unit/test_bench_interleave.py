"""bench/interleave.py: two sides take turns, one stopped while the other runs, and a side's iteration time
leaves out the time it was stopped.

Each side here spins until its own process has used SPIN_S of CPU per iteration: CPU time does not advance while
a process is stopped, so an iteration's true running time is SPIN_S (plus start-up noise), whatever the other
side does. A wall-clock sleep would not do: it goes on while the process is stopped.
"""

import sys
import time

import pytest

from bench.interleave import Side, run_in_turns

SPIN_S = 0.25  # side a's CPU seconds per iteration
OTHER_SPIN_S = 1.0  # side b's: long, so that counting b's turn in a's time could not pass for a loaded machine
ITERATIONS = 5


def _program(spin_s: float) -> str:
    return f"""
import json, time
for _ in range({ITERATIONS}):
    t = time.process_time()
    while time.process_time() - t < {spin_s}:
        pass
    print(json.dumps({{"end": time.time()}}), flush=True)
"""


def _side(name, sides=None, spin_s: float = SPIN_S):
    def start():
        def ends():
            return [line["end"] for line in side.printed("end")]

        side = Side(name, [sys.executable, "-c", _program(spin_s)], ends)
        if sides is not None:
            sides[name] = side
        return side

    return start


def test_sides_take_turns_and_stopped_time_is_left_out():
    started = time.time()
    sides = {}
    seconds = run_in_turns([_side("a", sides), _side("b", sides, OTHER_SPIN_S)], ITERATIONS, timeout_s=120)
    wall = time.time() - started
    for name, side in sides.items():
        # start-up + first iteration, run alone: the interpreter's start, then its CPU seconds (never less in wall)
        spin = SPIN_S if name == "a" else OTHER_SPIN_S
        assert started <= side.started_at and spin <= side.ends()[0] - side.started_at < spin + 10, name
    assert set(seconds) == {"a", "b"}
    assert all(len(per_iteration) == ITERATIONS - 1 for per_iteration in seconds.values()), seconds
    # Each iteration ran its side's CPU seconds: never less in wall time. b's turn (>= OTHER_SPIN_S) between two of
    # a's ends must not be counted in a's: with it a's iterations would take >= SPIN_S + OTHER_SPIN_S = 1.25 s;
    # without it SPIN_S plus polling (10 ms), or up to ~4x that on a machine loaded by other work.
    assert all(SPIN_S * 0.95 <= s < SPIN_S + 0.9 * OTHER_SPIN_S for s in seconds["a"]), seconds["a"]
    assert all(OTHER_SPIN_S * 0.95 <= s for s in seconds["b"]), seconds["b"]
    # one at a time: the run took at least the sum of both sides' CPU in wall time; on two cores, sides running side
    # by side would have taken about the larger one
    assert wall >= ITERATIONS * (SPIN_S + OTHER_SPIN_S) * 0.95


def test_a_side_that_dies_fails_the_measurement_with_its_stderr():
    def start():
        return Side("broken", [sys.executable, "-c", "import sys; sys.exit('no engine here')"], lambda: [])

    try:
        run_in_turns([start, _side("b")], ITERATIONS, timeout_s=60)
    except RuntimeError as e:
        assert "broken exited (rc 1)" in str(e) and "no engine here" in str(e)
    else:
        raise AssertionError("a side that exits early must fail the run")


CONTROLLER = """
import sys
sys.path.insert(0, sys.argv[1])
from bench.interleave import Side, run_in_turns
SLOW = "\\n".join([
    "import json, time",
    "for _ in range(1000):",
    "    time.sleep(0.2)",
    "    print(json.dumps({'end': time.time()}), flush=True)",
])

def start(name):
    def run():
        side = Side(name, [sys.executable, "-c", SLOW], lambda: [line["end"] for line in side.printed("end")])
        print("PID", side.proc.pid, flush=True)
        return side
    return run

run_in_turns([start("a"), start("b")], 1000, timeout_s=600)
"""


def test_a_controller_stopped_with_sigterm_takes_its_sides_with_it():
    import os
    import signal
    import subprocess
    from pathlib import Path

    from storage.liveness import pid_alive

    repo = str(Path(__file__).resolve().parents[2])
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER, repo], stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        while len(pids) < 2:  # both sides started: one of them is stopped (SIGSTOP) whenever the other runs
            line = controller.stdout.readline()
            assert line, "the controller ended before starting both sides"
            if line.startswith("PID "):
                pids.append(int(line.split()[1]))
        time.sleep(1.0)  # a few turns
        controller.send_signal(signal.SIGTERM)
        controller.wait(timeout=30)
    finally:
        controller.kill()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if pid_alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"sides {left} outlived their controller (one would stay stopped for good)"


def test_three_sides_take_turns_in_an_order_reversed_each_round():
    sides = {}
    started = time.time()
    seconds = run_in_turns([_side(name, sides) for name in "abc"], ITERATIONS, timeout_s=120)
    wall = time.time() - started
    assert set(seconds) == {"a", "b", "c"}
    # each side's iterations hold its own CPU seconds only, not the two others' turns: with them an iteration would
    # take >= 3 * SPIN_S; without, SPIN_S plus polling, or more on a loaded machine (0.60 s seen in a suite run)
    assert all(SPIN_S * 0.95 <= s < 3 * SPIN_S * 0.95 for per in seconds.values() for s in per), seconds
    assert wall >= 3 * ITERATIONS * SPIN_S * 0.95  # one at a time
    # the order of the ends of iteration 2 is a b c, of iteration 3 c b a (iteration 1: each alone, in start order)
    assert sorted("abc", key=lambda n: sides[n].ends()[1]) == ["a", "b", "c"]
    assert sorted("abc", key=lambda n: sides[n].ends()[2]) == ["c", "b", "a"]


def test_overhead_vs_refuses_a_tree_whose_modules_python_does_not_import(tmp_path):
    from bench.overhead import source_tree

    with pytest.raises(ValueError, match=f"--vs {tmp_path}: python there imports .*not that tree's modules"):
        source_tree(str(tmp_path))  # an empty folder: `import flows` finds this checkout's (editable install)


def test_overhead_refuses_a_run_too_short_for_its_quartiles_before_starting_anything():
    from bench.overhead import main

    # 2 iterations x 1 round: iteration 1 is excluded, one pair is left and quartiles need two (it used to fail at
    # the end, after every side had run)
    with pytest.raises(SystemExit, match=r"--iterations 2 --rounds 1 measures 1 iteration\(s\) per side"):
        main(["--iterations", "2", "--rounds", "1"])
