"""CheckedEnvironment and load_environment_factory: a broken environment is one error naming the environment,
the row and the turn; a well-behaved one passes through unchanged; the identity follows the code."""

from __future__ import annotations

import hashlib
import importlib.metadata

import pytest

from engines.environments.base import Observation
from engines.environments.checked import CheckedEnvironment, EnvironmentFailed
from engines.environments.loader import load_environment_factory

FIXTURES = "tests.fixtures.environments"


def _start(name: str, row_index: int = 7, sample_index: int = 1, **kwargs) -> CheckedEnvironment:
    return CheckedEnvironment.start(load_environment_factory(f"{FIXTURES}:{name}"), row_index, sample_index, **kwargs)


def _where(name: str) -> str:
    return rf"environment '{FIXTURES}:{name}' \(row 7, sample 1\)"


def test_a_well_behaved_environment_passes_through():
    env = _start("Countdown")
    assert env.reset({"turns": 2}) == "count 2"
    first = env.step([{"role": "assistant", "content": "a"}])
    second = env.step([{"role": "assistant", "content": "b"}])
    assert (first, env.turn) == (Observation(text="turn 1", reward=1.0, done=False, info={"n": 1}), 2)
    assert second.done and second.text == "turn 2"
    inner = env.env
    env.close()
    env.close()  # idempotent: the environment is closed once
    assert inner.closed == 1


@pytest.mark.parametrize(
    "name, when, message",
    [
        ("RaisesAtTurn2", "turn 2", r"raised KeyError: 'no such cell'"),
        ("ReturnsDict", "turn 1", r"step returned dict \{'text': 'x', 'done': True\}: expected an engines"),
        ("NanReward", "turn 1", r"step returned an Observation with reward float nan: expected a finite number"),
        ("SystemRole", "turn 1", r"role 'system': expected 'user' or 'tool'"),
        ("IntDone", "turn 1", r"done int 1: expected a bool"),
        ("SetInInfo", "turn 1", r"info is not JSON-able"),
        ("Exits", "turn 1", r"called sys.exit\(3\) \(an environment returns or raises"),
    ],
)
def test_a_broken_step_names_environment_row_and_turn(name, when, message):
    env = _start(name)
    env.reset({"turns": 3})
    with pytest.raises(EnvironmentFailed, match=f"^{_where(name)} {when}: .*{message}"):
        for _ in range(3):
            env.step([{"role": "assistant", "content": "a"}])
    env.close()


def test_an_exception_is_chained():
    env = _start("RaisesAtTurn2")
    env.reset({"turns": 3})
    env.step([])
    with pytest.raises(EnvironmentFailed) as caught:
        env.step([])
    assert isinstance(caught.value.__cause__, KeyError)


def test_a_hanging_step_times_out_and_frees_the_caller():
    env = _start("Hangs", call_timeout_s=0.3)
    env.reset({"turns": 1})
    with pytest.raises(EnvironmentFailed, match=rf"^{_where('Hangs')} turn 1: did not return within 0.3 s"):
        env.step([])
    with pytest.raises(EnvironmentFailed, match=r"turn 2: not called: an earlier call of this environment never"):
        env.step([])  # not run inline, where it would hang the caller
    env.close()  # must not wait for the stuck thread


@pytest.mark.parametrize(
    "name, message",
    [
        ("ResetReturnsList", r"reset: returned list \['hello'\]: expected a non-empty str or None"),
        ("NoStep", r"factory: built a NoStep without step"),
        ("factory_raises", r"factory: raised RuntimeError: no licence for this game"),
    ],
)
def test_a_broken_reset_or_factory_is_named(name, message):
    with pytest.raises(EnvironmentFailed, match=f"^{_where(name)} {message}"):
        _start(name).reset({"turns": 1})


def test_close_errors_raise_unless_another_error_is_in_flight():
    env = _start("CloseRaises")
    with pytest.raises(EnvironmentFailed, match=r"close: raised OSError: the database is locked"):
        env.close()
    quiet = _start("CloseRaises")
    quiet.close(raise_errors=False)


def test_step_after_done_is_refused():
    env = _start("Countdown")
    env.reset({"turns": 1})
    assert env.step([]).done
    with pytest.raises(EnvironmentFailed, match=r"turn 2: step called after the episode returned done"):
        env.step([])


def test_inline_calls_when_no_timeout():
    env = _start("Countdown", call_timeout_s=None)
    env.reset({"turns": 1})
    assert env.step([]).done and env._caller is None


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("Countdown", ValueError, r"environment spec 'Countdown' must be"),
        (f"{FIXTURES}:Missing", AttributeError, r"environment 'tests.fixtures.environments:Missing': .* no attribute"),
        ("/nowhere/env.py:Env", FileNotFoundError, r"environment '/nowhere/env.py:Env': file"),
    ],
)
def test_bad_specs_name_the_environment(spec, error, message):
    with pytest.raises(error, match=message):
        load_environment_factory(spec)


ENV_FILE = """
from engines.environments.base import Observation

class Env:
    {packages}
    def reset(self, row):
        return None
    def step(self, messages):
        return Observation(text="{text}", done=True)
    def close(self):
        pass
"""


def test_identity_follows_the_file_and_the_declared_packages(tmp_path):
    path = tmp_path / "env.py"
    path.write_text(ENV_FILE.format(packages="", text="a"))
    spec = f"{path}:Env"
    first = load_environment_factory(spec)
    assert first.identity == load_environment_factory(spec).identity  # stable
    path.write_text(ENV_FILE.format(packages="", text="b"))
    edited = load_environment_factory(spec)
    assert edited.identity != first.identity
    path.write_text(ENV_FILE.format(packages="identity_packages = ('pyarrow',)", text="b"))
    with_library = load_environment_factory(spec)
    # Derived here from its parts: the spec, the file's text, then the package's version.
    expected = f"{spec}\n{path.read_text()}\npyarrow=={importlib.metadata.version('pyarrow')}"
    assert with_library.identity == hashlib.sha256(expected.encode()).hexdigest()[:16]
