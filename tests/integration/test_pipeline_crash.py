"""A training process killed with SIGKILL in the middle of saving a checkpoint, then the same command again.

The kill comes after iteration 2's update wrote every checkpoint file to its scratch folder and before
any was staged: no exception handler, `finally` or atexit hook runs (a power cut, the OOM killer). Then
`ppoflow train` with the same config starts a new flow run, which must resume at iteration 2 (LATEST + 1),
leave iteration 1's committed checkpoint byte for byte as it was, remove the dead process's scratch folder,
and end with the same policy and metrics as a run that was never killed.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


# Set in os.environ by DeepSpeed set-up in this test process (earlier tests): a child must pick its own
# rendezvous port, or it would try to listen where this process already does.
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _train(config_path: Path, kill_while_saving: int | None = None) -> subprocess.CompletedProcess:
    """`ppoflow train CONFIG` in a child process; kill_while_saving=i: the child SIGKILLs itself once
    iteration i's checkpoint files are in scratch, before any is staged (tests/fixtures/kill_cli.py)."""
    child_env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    entry = ["flows.cli"] if kill_while_saving is None else ["tests.fixtures.kill_cli", str(kill_while_saving)]
    return subprocess.run([sys.executable, "-m", *entry, "train", str(config_path)], cwd=REPO,
                          env=child_env, capture_output=True, text=True, timeout=600)


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_killed_while_saving_resumes_and_ends_as_if_never_killed(prefect_api, tmp_path, tiny_model_dir,
                                                                      digits_dataset_dir):
    from flows.records import read_metrics
    from storage.checkpoints import is_committed, latest_iteration
    from storage.layout import layout_for

    root = str(tmp_path / "runs")
    killed = small_config(root, "killed", tiny_model_dir, digits_dataset_dir, iterations=2)
    config_path = tmp_path / "killed.yaml"
    config_path.write_text(killed.to_yaml())
    layout = layout_for(killed)
    checkpoints = Path(layout.checkpoints_dir)

    first = _train(config_path, kill_while_saving=2)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert latest_iteration(layout) == 1 and not is_committed(layout, 2)
    assert [r["iteration"] for r in read_metrics(layout)] == [1]
    left = [p for p in checkpoints.iterdir() if p.name.startswith(".ppoflow-ckpt.")]
    assert len(left) == 1 and (left[0] / "trainer").is_dir()  # the dead process's half-done save
    iteration_1 = _digests(checkpoints / "iter-000001")

    again = _train(config_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert latest_iteration(layout) == 2
    assert _digests(checkpoints / "iter-000001") == iteration_1  # never rewritten
    assert not any(p.name.startswith(".ppoflow-ckpt.") for p in checkpoints.iterdir())

    never_killed = small_config(root, "never-killed", tiny_model_dir, digits_dataset_dir, iterations=2)
    clean_path = tmp_path / "never-killed.yaml"
    clean_path.write_text(never_killed.to_yaml())
    assert _train(clean_path).returncode == 0
    got = load_file(str(checkpoints / "iter-000002" / "policy" / "model.safetensors"))
    want = load_file(str(Path(layout_for(never_killed).checkpoints_dir) / "iter-000002" / "policy" / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:  # same seeds, data and ops on one CPU rank, each run in a fresh process: exact
        assert (got[name] - want[name]).abs().max().item() == 0.0, name
    rows, clean_rows = read_metrics(layout), read_metrics(layout_for(never_killed))
    assert [r["iteration"] for r in rows] == [1, 2]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in clean_rows]
    assert [r["loss/policy"] for r in rows] == [r["loss/policy"] for r in clean_rows]
