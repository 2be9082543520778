"""adaptations/prefect_sigterm.py: a SIGTERM whose exception Python drops (its handler ran inside a weakref
callback) is delivered again where the run would go on.

Each case runs in a Python process of its own: it sends SIGTERM to itself. The signal lands inside a weakref
callback deterministically: the callback calls `os.kill` on its own process, and CPython runs the Python handler
before `os.kill` returns, so the handler's exception leaves the callback, which Python reports as "Exception
ignored" and drops, the way it does when the garbage collector runs a callback at the moment a signal comes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A weakref callback that receives SIGTERM while it runs; then a stage that should never run, then a check point.
DROP = """
import os, signal, weakref

class Box:
    pass

def sigterm_inside_the_callback(_ref):
    os.kill(os.getpid(), signal.SIGTERM)

box = Box()
ref = weakref.ref(box, sigterm_inside_the_callback)
"""


def _run(body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(DROP) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )


def test_upstream_drops_the_termination_signal_raised_inside_a_weakref_callback():
    """Prefect's own handler alone: the flow body goes on after the SIGTERM. Once this fails (Prefect or Python no
    longer drop it), remember_sigterm can go."""
    done = _run(
        """
        from prefect.utilities.engine import capture_sigterm
        try:
            with capture_sigterm():  # what Prefect's flow engine puts around a flow run
                del box  # the callback runs here, and SIGTERM with it
                print("the next stage ran")
        except BaseException as e:
            print("stopped by", type(e).__name__)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == ["the next stage ran"], done.stdout
    assert "Exception ignored" in done.stderr and "TerminationSignal" in done.stderr, done.stderr


def test_a_dropped_sigterm_inside_a_flow_run_is_delivered_again_and_ends_as_terminated():
    """As `ppoflow train` runs: ppoflow's handler outermost (Terminated), Prefect's inside the flow run. The signal
    dropped in the callback is delivered again at the next check point, where Prefect's handler raises; Prefect
    then hands the signal to the handler it replaced, which raises Terminated: what the CLI reports as stopped by
    SIGTERM (exit 143)."""
    done = _run(
        """
        from adaptations import install_process_adaptations
        from adaptations.prefect_sigterm import redeliver_lost_sigterm
        from flows.failure import raise_on_sigterm
        from prefect.utilities.engine import capture_sigterm
        install_process_adaptations()
        raise_on_sigterm()
        redeliver_lost_sigterm()  # nothing noted yet: nothing sent
        print("before the drop")
        try:
            with capture_sigterm():
                del box
                print("dropped")
                redeliver_lost_sigterm()  # the check point before the next stage
                print("the next stage ran")
        except BaseException as e:
            print("stopped by", type(e).__name__, "after", type(e.__context__).__name__)
        """
    )
    lines = done.stdout.strip().splitlines()
    assert lines == ["before the drop", "dropped", "stopped by Terminated after TerminationSignal"], (
        lines,
        done.stderr,
    )
    assert "Exception ignored" in done.stderr, done.stderr  # it was dropped once, as upstream drops it


def test_ppoflows_own_handler_dropped_outside_a_flow_run_is_delivered_again():
    done = _run(
        """
        from adaptations.prefect_sigterm import redeliver_lost_sigterm
        from flows.failure import raise_on_sigterm
        raise_on_sigterm()
        try:
            del box
            print("dropped")
            redeliver_lost_sigterm()
            print("the next stage ran")
        except BaseException as e:
            print("stopped by", type(e).__name__)
        """
    )
    assert done.stdout.strip().splitlines() == ["dropped", "stopped by Terminated"], (done.stdout, done.stderr)


def test_only_the_main_thread_delivers_a_noted_sigterm_again():
    """A check point in another thread (a pipelined iteration's) sends nothing: the main thread's own check point
    does."""
    done = _run(
        """
        import threading
        from adaptations.prefect_sigterm import redeliver_lost_sigterm
        from flows.failure import raise_on_sigterm
        raise_on_sigterm()
        del box
        other = threading.Thread(target=redeliver_lost_sigterm)
        other.start(); other.join()
        print("the other thread sent nothing")
        try:
            redeliver_lost_sigterm()
        except BaseException as e:
            print("stopped by", type(e).__name__)
        """
    )
    assert done.stdout.strip().splitlines() == ["the other thread sent nothing", "stopped by Terminated"], (
        done.stdout,
        done.stderr,
    )


def test_a_command_stopped_by_sigterm_exits_within_its_grace_whatever_its_threads_do(tmp_path):
    """cli/capture.run_with_capture after Terminated: the one message, then exit 143 within STOP_GRACE_S even when a
    non-daemon thread (a stage still running, a lock never released) would hold the interpreter's shutdown for an
    hour. The grace is set to 2 s here from outside (the module's constant)."""
    script = f"""
import sys, threading, time
import cli.capture
from engines.toy.run_config import toy_config
from flows.failure import Terminated

cli.capture.STOP_GRACE_S = 2.0
cfg = toy_config({str(tmp_path / "runs")!r}, "stopped", {str(tmp_path / "model")!r}, {str(tmp_path / "data")!r})

class Args:
    verbose = False

def body(console):
    threading.Thread(target=time.sleep, args=(3600,), name="stage-still-running").start()
    raise Terminated("stopped by SIGTERM")

sys.exit(cli.capture.run_with_capture(cfg, "train", Args(), body))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    took_s = time.monotonic() - started
    assert done.returncode == 143, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "ppoflow: error: Terminated: stopped by SIGTERM" in done.stdout, done.stdout[-2000:]
    assert took_s < 60, took_s  # not the hour the thread sleeps; the imports take most of it on a busy machine


def test_installed_inside_a_flow_run_prefects_bridge_is_still_found_and_notes():
    """A deployment's run installs the adaptations inside its flow (ppo_training's first line), after Prefect put
    its handler in place: Prefect must still find its bridge there (what a nested flow reuses and a cancellation's
    acknowledgement checks), and a signal dropped from then on is delivered again."""
    done = _run(
        """
        from prefect.utilities import engine
        from prefect.utilities.engine import capture_sigterm, is_prefect_sigterm_handler_installed
        from adaptations.prefect_sigterm import redeliver_lost_sigterm, remember_sigterm
        try:
            with capture_sigterm():  # the deployment's flow run
                remember_sigterm()
                print("bridge found:", is_prefect_sigterm_handler_installed())
                with capture_sigterm():  # an iteration's subflow
                    print("subflow reuses it:", engine._prefect_sigterm_handler_depth == 2)
                    del box
                    redeliver_lost_sigterm()
                    print("the next stage ran")
        except BaseException as e:
            print("stopped by", type(e).__name__)
        """
    )
    lines = done.stdout.strip().splitlines()
    assert lines[:2] == ["bridge found: True", "subflow reuses it: True"], (lines, done.stderr)
    # Prefect's own outcome of a SIGTERM in a flow run of a process with the default handler: TerminationSignal
    # out of the flow, then the default action (the process ends by SIGTERM) once the outer bridge hands it on.
    assert done.returncode == -15 or lines[2:] == ["stopped by TerminationSignal"], (done.returncode, lines)
    assert "the next stage ran" not in lines, lines
