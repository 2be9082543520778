"""A reader follows ppo_iteration into each stage function in at most 6 ppoflow frames (issue 51).

Each stage function (stages.<stage>.run_<stage>, looked up on its module at call time) is wrapped from outside to
record the Python stack when it is called, in a one-iteration in-process run on the tiny model with an eval due.
The frames counted are ppoflow's own, from ppo_iteration down to the stage function itself; Prefect's frames in
between (the task engine) are counted apart, and the test's wrapper is not counted.

Hand count of the in-process path, the one a reader follows with a call-graph tool:
    flows/iteration.py        ppo_iteration
    runtime/executors.py      InProcess.run       (the stage's executor, chosen once per run)
    runtime/stage_runs.py     run_stage_in_process
    tasks/stage_tasks.py      _<stage>            (the task's body, entered from Prefect's task engine)
    tasks/stage_tasks.py      _in_stage           (lease, deadline)
    stages/<stage>.py         run_<stage>
= 6 frames. The count is asserted against that listing, so a frame added anywhere on the path fails here by name.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest

from tests.fixtures.stack_cli import STAGE_FUNCTIONS
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
MAX_FRAMES = 6
EXPECTED = STAGE_FUNCTIONS  # stage -> its stage function (module, name); the hand count above gives the frames between


def ppoflow_frames(stack: list[traceback.FrameSummary], start: str = "ppo_iteration") -> list[str]:
    """`file:function` of the stack's frames in the project's own packages (not site-packages, not tests/), from the
    innermost frame named `start` to the end; [] when `start` is not on the stack."""
    starts = [i for i, frame in enumerate(stack) if frame.name == start]
    if not starts:
        return []
    own = []
    for frame in stack[starts[-1] :]:
        path = Path(frame.filename).resolve()
        if (
            path.is_relative_to(REPO)
            and not path.is_relative_to(REPO / ".venv")
            and not path.is_relative_to(REPO / "tests")
        ):
            own.append(f"{path.relative_to(REPO)}:{frame.name}")
    return own


def test_ppoflow_frames_counts_only_the_projects_frames_from_the_start():
    """The counter against a hand-built stack: two of the project's frames below a test frame and a library frame."""
    stack = [
        traceback.FrameSummary(str(REPO / "tests" / "x.py"), 1, "ppo_iteration"),  # a test's own, before the start
        traceback.FrameSummary(str(REPO / "flows" / "iteration.py"), 1, "ppo_iteration"),
        traceback.FrameSummary(str(REPO / ".venv" / "lib" / "prefect" / "task_engine.py"), 1, "call_task_fn"),
        traceback.FrameSummary(str(REPO / "tasks" / "stage_tasks.py"), 1, "_score"),
        traceback.FrameSummary(str(REPO / "tests" / "spy.py"), 1, "spy"),
    ]
    assert ppoflow_frames(stack) == ["flows/iteration.py:ppo_iteration", "tasks/stage_tasks.py:_score"]
    assert ppoflow_frames(stack[2:]) == []


def test_each_stage_function_is_at_most_six_frames_below_ppo_iteration(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    import importlib

    from engines.toy.task import make_rows
    from flows.api import train

    held_out = tmp_path / "held_out.jsonl"
    rows = make_rows(8, seed=11)
    held_out.write_text(
        "".join(json.dumps({"prompt": p, "label": y}) + "\n" for p, y in zip(rows["prompt"], rows["label"]))
    )
    cfg = small_config(
        str(tmp_path / "runs"),
        "frames",
        tiny_model_dir,
        digits_dataset_dir,
        iterations=1,
        eval={"data_path": str(held_out), "every": 1, "n_samples": 1},
    )
    chains: dict[str, list[str]] = {}
    for stage, (module_name, name) in EXPECTED.items():
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def spy(*args, _stage=stage, _original=original, _where=f"{module_name.replace('.', '/')}.py:{name}", **kwargs):
            chains[_stage] = ppoflow_frames(traceback.extract_stack()[:-1]) + [_where]
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    result = train(cfg)
    assert [row["iteration"] for row in result["iterations"]] == [1]
    assert sorted(chains) == sorted(EXPECTED), chains
    for stage, chain in chains.items():
        task_body = "_eval" if stage == "eval" else f"_{stage}"
        assert chain == [
            "flows/iteration.py:ppo_iteration",
            "runtime/executors.py:run",
            "runtime/stage_runs.py:run_stage_in_process",
            f"tasks/stage_tasks.py:{task_body}",
            "tasks/stage_tasks.py:_in_stage",
            chain[-1],
        ], (stage, chain)
        assert len(chain) <= MAX_FRAMES, (stage, chain)
