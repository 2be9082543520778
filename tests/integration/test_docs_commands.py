"""The commands of docs/your-own-run.md and docs/python-api.md run as written, on the tiny model.

A project folder is laid out as the page says (models/my-sft-model, data/train.jsonl, my_reward.py, my-run.yaml),
each file taken from the page: the config block, the reward block. The config is cut down for seconds of compute
(HF generate, 4 prompts x 2 samples of 4 tokens, one optimizer step), merged in as YAML so that the commands
themselves stay as written. Then, against the session's Prefect server:
- the CLI block (`ppoflow train my-run.yaml`) trains iteration 1;
- in one Python process, as a notebook would, the "Your own run" Python block (`train("my-run.yaml")`, with
  run.iterations raised to 2: it resumes at LATEST + 1) and then the Python API page's block
  (`overrides=["run.iterations=5"]`: iterations 3 to 5).
The run must end with iterations 1..5 committed, each metrics row written once, and the layout the page shows.
The quick start's `ppoflow demo` runs in tests/integration/test_cli_terminal.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engines.toy.task import make_rows
from tests.fixtures.docs import REPO, named_block

pytestmark = pytest.mark.slow
SMALL = {
    "rollout": {"engine": "hf", "prompts_per_iteration": 4, "n_samples": 2, "max_new_tokens": 4},
    "train": {"train_batch_size": 8, "micro_batch_size": 8},
    "pipeline": {"retries": 0},
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _write_config(project: Path, iterations: int) -> None:
    config = _merge(yaml.safe_load(named_block("your-run-config").text), SMALL)
    config["run"]["iterations"] = iterations
    (project / "my-run.yaml").write_text(yaml.safe_dump(config))


def _env(prefect_server: str) -> dict[str, str]:
    # Variables DeepSpeed set in this test process (earlier tests) would make the child reuse its port.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.pop("MASTER_PORT", None)
    env.update(PYTHONPATH=str(REPO), PREFECT_API_URL=prefect_server, COLUMNS="120")
    return env


@pytest.fixture
def project(tmp_path, tiny_model_dir) -> Path:
    """The folder "Your own run" describes, with the page's own config and reward function."""
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "my-sft-model")
    (tmp_path / "data").mkdir()
    rows = make_rows(64, seed=3)  # the digits task: "repeat 3 :" with label "3"
    lines = [json.dumps({"prompt": p, "label": label}) for p, label in zip(rows["prompt"], rows["label"])]
    (tmp_path / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "my_reward.py").write_text(named_block("your-run-reward").text)
    return tmp_path


def test_your_own_run_from_the_cli_then_from_python(project, prefect_server):
    env = _env(prefect_server)
    _write_config(project, iterations=1)
    command = shlex.split(named_block("your-run-cli").text)
    assert command[:2] == ["ppoflow", "train"]
    command[0] = str(Path(sys.executable).parent / "ppoflow")  # the console script this venv installed
    cli = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=900)
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    assert "reward" in cli.stdout and "metrics:" in cli.stdout  # the iteration table and where things are

    _write_config(project, iterations=2)  # the page's Python block resumes the same run at LATEST + 1
    script = named_block("your-run-python").text + "\n" + named_block("python-api").text
    script += '\nprint("API", result["first_iteration"], result["last_iteration"], len(result["iterations"]))\n'
    python = subprocess.run(
        [sys.executable, "-c", script], cwd=project, env=env, capture_output=True, text=True, timeout=900
    )
    assert python.returncode == 0, python.stdout[-3000:] + python.stderr[-3000:]
    # first call: iteration 2 (its reward printed after the run's URI); second call: iterations 3..5
    assert "API 3 5 3" in python.stdout
    # print(result["run_uri"], result["iterations"][-1]["reward/mean"]): the run's folder and a digits reward
    printed = re.findall(r"^\S*runs/my-run\s+(\S+)$", python.stdout, re.M)
    assert printed and 0.0 <= float(printed[0]) <= 1.0, python.stdout[-3000:]

    run = project / "runs" / "my-run"

    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert json.loads((run / "LATEST").read_text())["iteration"] == 5
    # the layout the page lists
    assert (run / "config.yaml").is_file() and (run / "run.json").is_file()
    assert (run / "iter-000003" / "rollout" / "_manifest.json").is_file()
    assert (run / "checkpoints" / "iter-000005" / "policy" / "config.json").is_file()
    assert len(list((run / "logs").glob("train-*.log"))) == 3  # one per command or call
