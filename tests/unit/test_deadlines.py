"""Stage deadlines (tasks/deadlines.py): how a deadline is derived, and what happens when a stage passes it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ppoflow.config import ConfigError, PPOFlowConfig, apply_overrides, build_config
from tasks.deadlines import EXIT_DEADLINE, StageDeadlineExceeded, deadline, deadline_s


def _cfg(**deadlines) -> PPOFlowConfig:
    return PPOFlowConfig.model_validate({"pipeline": {"deadlines": deadlines}})


class TestDeadlineSeconds:
    def test_median_times_factor(self):
        # median of [10, 40, 12] is 12; 5 x 12 = 60, above a floor of 30
        seconds, why = deadline_s(_cfg(factor=5, floor_s=30), "update", [10.0, 40.0, 12.0], first_here=False)
        assert seconds == 60.0
        assert "median 12.0 s of timing/update over the last 3 iterations" in why

    def test_only_the_last_history_rows_count(self):
        # history 2: the median of [100, 200] is 150 -> 3 x 150 = 450; the old 1 s rows are not in it
        seconds, _ = deadline_s(_cfg(factor=3, floor_s=1, history=2), "score", [1.0, 1.0, 1.0, 100.0, 200.0], False)
        assert seconds == 450.0

    def test_floor(self):
        seconds, _ = deadline_s(_cfg(factor=5, floor_s=300), "score", [2.0, 2.0], first_here=False)
        assert seconds == 300.0

    def test_first_run_in_a_process_adds_the_start_up_allowance(self):
        # 5 x 100 = 500, + first_s 1000 for this process's engine start-up
        seconds, why = deadline_s(_cfg(factor=5, floor_s=1, first_s=1000), "rollout", [100.0], first_here=True)
        assert seconds == 1500.0 and "first_s = 1000 s" in why

    def test_no_history_is_the_first_iteration_allowance(self):
        assert deadline_s(_cfg(first_s=900), "update", [], first_here=True)[0] == 900.0
        assert deadline_s(_cfg(first_s=900), "update", [], first_here=False)[0] == 900.0

    def test_fixed_per_stage_and_zero_is_none(self):
        cfg = _cfg(stages={"update": 42, "score": 0})
        assert deadline_s(cfg, "update", [1000.0], first_here=True) == (42.0, "pipeline.deadlines.stages.update = 42 s")
        assert deadline_s(cfg, "score", [1.0], first_here=False)[0] is None
        # a rollout part has the rollout's deadline
        assert deadline_s(_cfg(stages={"rollout": 7}), "rollout-part-00001-of-00002", [], False)[0] == 7.0

    def test_disabled(self):
        assert deadline_s(_cfg(enabled=False), "update", [1.0], first_here=True)[0] is None

    def test_bad_settings_are_refused_naming_the_field(self):
        with pytest.raises(ConfigError, match="pipeline.deadlines.stages.*unknown stage 'updat'"):
            build_config(apply_overrides({}, ["pipeline.deadlines.stages={updat: 5}"]))
        with pytest.raises(ConfigError, match="pipeline.deadlines.factor"):
            build_config(apply_overrides({}, ["pipeline.deadlines.factor=0.5"]))


def _fixed(seconds: float, grace_s: float = 30.0, tmp_root: str = "") -> PPOFlowConfig:
    return PPOFlowConfig.model_validate(
        {
            "run": {"root": tmp_root},
            "pipeline": {"deadlines": {"stages": {"update": seconds}, "grace_s": grace_s}},
        }
    )


class TestDeadline:
    def test_a_stage_in_python_is_interrupted_at_its_deadline(self, tmp_path):
        def hangs():
            while True:  # a stage stuck in Python (a poll loop): interruptible between two operations
                time.sleep(0.02)

        started = time.monotonic()
        with pytest.raises(StageDeadlineExceeded) as caught:
            with deadline(_fixed(0.5, tmp_root=str(tmp_path)), 3, "update"):
                hangs()
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 5.0
        text = str(caught.value)
        assert "stage update of iteration 3 ran past its deadline of 0.5 s" in text
        assert "pipeline.deadlines.stages.update" in text

    def test_a_body_that_ends_in_time_is_untouched_and_nothing_lands_later(self, tmp_path):
        cfg = _fixed(0.3, tmp_root=str(tmp_path))
        with deadline(cfg, 1, "update"):
            result = 41 + 1
        assert result == 42
        time.sleep(0.6)  # past the deadline: the finished watch must not interrupt this thread now
        assert threading.current_thread().is_alive()

    def test_the_body_error_caused_by_the_interruption_is_kept_as_the_cause(self, tmp_path):
        def converts():
            try:
                while True:
                    time.sleep(0.02)
            except Exception as error:  # stage code that wraps every error it meets
                raise ValueError("engine said: interrupted") from error

        with pytest.raises(StageDeadlineExceeded) as caught:
            with deadline(_fixed(0.3, tmp_root=str(tmp_path)), 2, "update"):
                converts()
        assert isinstance(caught.value.__cause__, ValueError)

    def test_a_stage_blocked_in_native_code_ends_its_process_with_one_message(self, tmp_path):
        # time.sleep(600) cannot be interrupted by an exception sent to its thread: grace_s later the process ends.
        script = textwrap.dedent(
            f"""
            import time
            from ppoflow.config import PPOFlowConfig
            from tasks.deadlines import deadline
            cfg = PPOFlowConfig.model_validate(
                {{"run": {{"root": {str(tmp_path)!r}}},
                  "pipeline": {{"deadlines": {{"stages": {{"update": 0.5}}, "grace_s": 1.0}}}}}})
            with deadline(cfg, 4, "update"):
                time.sleep(600)
            print("not reached")
            """
        )
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == EXIT_DEADLINE, done.stderr
        assert time.monotonic() - started < 60
        assert "not reached" not in done.stdout
        lines = [line for line in done.stderr.splitlines() if line.startswith("ppoflow: error:")]
        assert len(lines) == 1, done.stderr
        assert "stage update of iteration 4 ran past its deadline" in lines[0]
        assert "grace_s = 1 s" in lines[0] and "resumes from its last checkpoint" in lines[0]
