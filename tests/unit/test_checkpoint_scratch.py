"""Scratch folders of checkpoint saves: one left by a process killed mid-save is removed by the next save
on the same machine; those of live processes, of other machines and of unknown names are kept."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import storage.scratch as scratch
from ppoflow.config import StorageConfig
from storage.layout import RunLayout

REPO = Path(__file__).resolve().parents[2]

# Enters checkpoint_scratch, writes 1 MiB as a save would, prints the folder, then dies by SIGKILL (no
# cleanup of any kind can run: no finally, no atexit, no TemporaryDirectory finaliser).
KILLED_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from ppoflow.config import StorageConfig
    from storage.scratch import checkpoint_scratch
    from storage.layout import RunLayout
    with checkpoint_scratch(RunLayout(sys.argv[2], "run-s", StorageConfig())) as tmp:
        with open(os.path.join(tmp, "actor_optimizer.safetensors"), "wb") as f:
            f.write(os.urandom(2**20))
        print(tmp, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _killed_mid_save(root: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_MID_SAVE, str(REPO), str(root)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return Path(proc.stdout.strip())


def test_a_scratch_folder_left_by_a_killed_save_is_removed_by_the_next_one(tmp_path):
    layout = RunLayout(str(tmp_path / "runs"), "run-s", StorageConfig())
    first = _killed_mid_save(tmp_path / "runs")
    # the crash really leaves it: nothing else would ever delete it
    assert (first / "actor_optimizer.safetensors").stat().st_size == 2**20
    assert first.parent == Path(layout.checkpoints_dir)
    second = _killed_mid_save(tmp_path / "runs")  # a retry that dies too: it removed the first one
    assert not first.exists() and (second / "actor_optimizer.safetensors").is_file()
    with scratch.checkpoint_scratch(layout) as tmp:
        assert not second.exists()
        assert os.path.isdir(tmp) and Path(tmp).parent == Path(layout.checkpoints_dir)
    assert sorted(os.listdir(layout.checkpoints_dir)) == []


def test_scratch_of_live_processes_other_machines_and_unknown_names_is_kept(tmp_path):
    layout = RunLayout(str(tmp_path / "runs"), "run-s", StorageConfig())
    parent = Path(layout.checkpoints_dir)
    parent.mkdir(parents=True)
    host = "".join(c if c.isalnum() else "-" for c in socket.gethostname())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kept = [
            parent / f".ppoflow-ckpt.{host}.{sleeper.pid}.abc123",  # its writer is alive
            parent / f".ppoflow-ckpt.{host}.{os.getpid()}.def456",  # this process's own
            parent / ".ppoflow-ckpt.some-other-host.1.ghi789",  # another machine: liveness unknown
            parent / ".ppoflow-ckpt-xyz",  # an older version's name: no pid to check
            parent / "iter-000001",
        ]  # a checkpoint, not scratch
        for folder in kept:
            folder.mkdir()
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        )
        stale = parent / f".ppoflow-ckpt.{host}.{int(dead.stdout)}.jkl012"
        stale.mkdir()
        assert scratch.remove_stale_scratch(str(parent)) == [str(stale)]
        assert all(folder.is_dir() for folder in kept) and not stale.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
