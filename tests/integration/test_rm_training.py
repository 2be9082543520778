"""`ppoflow train-rm` killed with SIGKILL after its first committed unit, then run again, ends exactly like a run
that was never killed; its output loads as the score stage's reward model and as a critic.

Both runs start as real processes at the same time (`python -m cli train-rm`, one thread each, the test
session's Prefect server); the test polls the killed run's storage for unit 1's commit marker and kills it
from outside. The command started again resumes at LATEST + 1 from the committed weights, optimizer,
scheduler and RNG states and the step cursor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.fixtures.terminal import library_lines

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # a child picks its own


def _config(tmp_path: Path, run: str, model_dir: Path, data_path: Path) -> Path:
    from ppoflow.config import build_config

    cfg = build_config(
        {
            "run": {"name": run, "root": str(tmp_path / "runs"), "seed": 5},
            "model": {"policy_path": str(model_dir)},
            "train": {"zero_stage": 2, "warmup_steps": 2, "lr_schedule": "cosine"},
            "rm_train": {
                "data_path": str(data_path),
                "eval_fraction": 0.25,
                "epochs": 2,
                "batch_size": 8,
                "micro_batch_size": 4,
                "steps_per_unit": 5,
                "lr": 1e-3,
                "normalize": True,
            },
            "pipeline": {"retries": 0, "retry_delay_s": 0},
        },
        "test",
    )
    path = tmp_path / f"{run}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _start(config: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    # a console wide enough for the model's path on one line: rich folds a long line inside a word (the tmp path is
    # longer under pytest-xdist: .../popen-gw1/...)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), COLUMNS="400")
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "train-rm", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(process: subprocess.Popen) -> str:
    """Wait for a run that must succeed; its terminal holds ppoflow's own lines only (unit lines, where the model
    is), the libraries' output having gone to the run's log file."""
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-4000:]
    assert not library_lines(output), "library output reached the terminal:\n" + output[-3000:]
    assert output.count("reward model: ") == 1, output[-3000:]
    return output


def test_a_killed_rm_run_resumes_to_the_uninterrupted_result(prefect_api, tmp_path, tiny_model_dir):
    from engines.models import load_critic
    from engines.rewards.base import RewardBatch
    from engines.rewards.model import RewardModelSource
    from engines.toy.preferences import build_preferences
    from flows.records import read_metrics
    from storage.checkpoints import latest_iteration
    from storage.layout import RunLayout

    data = build_preferences(tmp_path / "pairs.jsonl", num_pairs=48, seed=3)  # 36 train pairs: 4 steps/epoch
    killed_cfg, clean_cfg = (_config(tmp_path, name, tiny_model_dir, data) for name in ("killed", "clean"))
    killed_layout, clean_layout = (RunLayout(str(tmp_path / "runs"), name) for name in ("killed", "clean"))
    marker = Path(killed_layout.checkpoint_dir(1)) / "_COMMITTED"

    clean, killed = _start(clean_cfg), _start(killed_cfg)
    deadline = time.time() + 400
    while not marker.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    killed.kill()  # SIGKILL: no handler, finally or atexit runs
    output = killed.communicate()[0]
    assert killed.returncode == -signal.SIGKILL, output[-3000:]
    resumed_from = latest_iteration(killed_layout)
    assert resumed_from is not None and resumed_from < 2, output[-3000:]  # 8 steps in units of 5: 2 units

    _finish(_start(killed_cfg))  # the same command again
    clean_output = _finish(clean)

    got_dir = Path(killed_layout.run_dir) / "reward_model"
    want_dir = Path(clean_layout.run_dir) / "reward_model"
    got, want = load_file(str(got_dir / "model.safetensors")), load_file(str(want_dir / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:  # same seed, data order and ops on one CPU thread, in fresh processes: exact
        assert (got[name] - want[name]).abs().max().item() == 0.0, name
    rows, clean_rows = read_metrics(killed_layout), read_metrics(clean_layout)
    last = clean_rows[-1]  # the terminal's last lines: where the model is and how it did on the eval pairs
    held_out = f"(eval accuracy {last['rm/eval_accuracy']:.3f} on {last['rm/eval_pairs']} pairs"
    words = " ".join(clean_output.split())
    assert f"reward model: {clean_layout.run_dir}/reward_model {held_out}" in words, clean_output[-2000:]
    assert [r["iteration"] for r in rows] == [1, 2] and [r["rm/step"] for r in rows] == [5, 8]
    # a kill between unit 1's commit and its metrics line is repaired from the commit marker
    for key in ("rm/loss", "rm/accuracy", "rm/eval_loss", "rm/eval_accuracy", "optim/lr"):
        assert [r[key] for r in rows] == [r[key] for r in clean_rows], key

    # The output is what the score stage and the critic load as they are.
    source = RewardModelSource(got_dir)
    assert (source.norm_mean, source.norm_std) == (rows[-1]["rm/eval_score_mean"], rows[-1]["rm/eval_score_std"])
    prompt = "user : say 3 : assistant : "
    scores = source.score(RewardBatch([prompt, prompt], ["3 3 3", "w1"], [[]] * 2, [[]] * 2, ["3", "3"]))
    assert all(isinstance(s, float) for s in scores)
    critic = load_critic(got_dir)
    assert (critic.value_head.weight == got["score.weight"]).all()


def test_a_failing_rm_run_gives_one_message_and_the_traceback_in_the_log(prefect_api, tmp_path, tiny_model_dir):
    """Pairs whose file has a line that is not JSON: exit 1, one message naming the file and line, the log file
    holding the traceback, and the command that resumes; nothing but that on the terminal."""
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "say 3", "chosen": "3 3", "rejected": "w1 w2"}\n{"prompt": "say 4", "chosen": \n')
    config = _config(tmp_path, "broken", tiny_model_dir, data)
    process = _start(config)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 1, output[-4000:]
    assert output.count("error:") == 1 and "Traceback" not in output, output[-4000:]
    assert "pairs.jsonl" in output and "line 2" in output, output[-4000:]
    assert not library_lines(output), output[-4000:]
    resume = next(line for line in output.splitlines() if line.strip().startswith("resume:"))
    assert resume.split("resume:")[1].split() == ["ppoflow", "train-rm", str(config)]
    log_file = Path(next(line for line in output.splitlines() if line.strip().startswith("log:")).split()[1])
    assert log_file.parent == tmp_path / "runs" / "broken" / "logs"
    assert "Traceback (most recent call last)" in log_file.read_text()


def test_a_finished_unit_comes_back_from_its_cache(prefect_api, tmp_path, tiny_model_dir):
    """What a Retry of a failed rm-training flow run does for the stages that had finished: the same stage again,
    with the same inputs, finds its persisted manifest by its key (tasks/cache_keys.py) instead of running. Running
    unit 1 again would not even be possible: its checkpoint is committed and is never overwritten."""
    from engines.toy.preferences import build_preferences
    from ppoflow.config import load_config
    from runtime.executors import run_stage
    from stages.reward_model import start_ref
    from storage.layout import layout_for
    from storage.stage_records import read_stage_record

    data = build_preferences(tmp_path / "pairs.jsonl", num_pairs=24, seed=3)  # 18 train pairs: 2 steps an epoch
    cfg = load_config(str(_config(tmp_path, "cached", tiny_model_dir, data)))  # 2 epochs, units of <= 5 steps
    plan = run_stage(cfg, "rm-prepare", 0)
    unit = run_stage(cfg, "rm-unit", 1, plan=plan, start=start_ref(cfg, 1))
    assert (plan.units, unit.steps) == (1, (0, 4))
    assert read_stage_record(layout_for(cfg), 1, "rm-unit") == unit.model_dump(mode="json")

    plan_again = run_stage(cfg, "rm-prepare", 0)
    assert plan_again == plan
    # equal to the field, the first run's wall seconds included: the persisted result, not a second run
    assert run_stage(cfg, "rm-unit", 1, plan=plan_again, start=start_ref(cfg, 1)) == unit
