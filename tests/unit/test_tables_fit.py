"""Tables that fit the width they are printed at and stay readable on a pipe (issue 56, ppoflow/tables.py):
`ppoflow shards stats|ls` and `runs show` through the real CLI, stdout a pipe, at $COLUMNS=80."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ppoflow.tables import column_groups, table_width
from storage.fs import write_json
from storage.layout import RunLayout
from storage.shards import write_shards
from storage.synthetic import synthetic_table

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, columns: int = 80, returncode: int = 0) -> str:
    """`ppoflow ARGS` with stdout a pipe, as `| cat` sees it; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns)}
    done = subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == returncode, done.stdout + done.stderr
    return done.stdout


def _by_key(text: str, first: str) -> dict[str, list[str]]:
    """Each row's cells joined across the tables its columns were split into (the key cell heads each one)."""
    joined: dict[str, list[str]] = {}
    for cells in _rows(text, first):
        joined.setdefault(cells[0], [cells[0]]).extend(cells[1:])
    return joined


def _rows(text: str, first: str) -> list[list[str]]:
    """The body rows of every table in `text` whose first cell starts with `first`, as lists of cells."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].startswith(first):
            rows.append(cells)
    return rows


def test_column_groups_keep_the_key_column_and_fit_the_width():
    # widths 10, 8, 8, 30: all four need 10+8+8+30 + 3*4 + 1 = 69 columns.
    assert table_width([10, 8, 8, 30]) == 69
    assert column_groups([10, 8, 8, 30], 69) == [[0, 1, 2, 3]]
    # At 40: [0,1,2] needs 26+10 = 36 <= 40; adding 3 (30) would need 69: a second table [0, 3] (40 + 7 = 47 > 40,
    # but a column too wide for any table still gets one of its own, printed whole).
    assert column_groups([10, 8, 8, 30], 40) == [[0, 1, 2], [0, 3]]
    assert column_groups([10], 5) == [[0]]


@pytest.fixture
def run(tmp_path):
    """A run whose root is a long path, with iteration 1's rollout and scored folders (40 rows each)."""
    root = tmp_path / ("a-rather-long-folder-name-" * 3) / "runs"
    layout = RunLayout(str(root), "run-x")
    write_shards(layout.fs, layout.stage_dir(1, "rollout"), synthetic_table("rollout", 40, seed=21), "rollout")
    write_shards(layout.fs, layout.stage_dir(1, "scored"), synthetic_table("scored", 40, seed=22), "scored")
    return layout


def test_shards_stats_on_a_pipe_keeps_every_cell_whole(run):
    # Before: 9 columns squeezed into 80, cells cut with … and the `rows` column blank.
    text = _cli("shards", "stats", run.url(run.run_dir))
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines() if line.startswith(("┏", "┃", "│", "└")))
    by_folder = _by_key(text, "iter-000001/")  # the folder heads every table the columns are split into
    assert set(by_folder) == {"iter-000001/rollout", "iter-000001/scored"}
    for folder, cells in by_folder.items():
        assert len(cells) == 9 and all(cells), (folder, cells)  # folder .. finish: none blank
        assert cells[1] == folder.split("/")[1] and cells[2] == "40"
    header = [c.strip() for line in text.splitlines() if line.startswith("┃") for c in line.split("┃")[1:-1]]
    assert {"rows", "prompt len", "reward mean±std", "versions", "finish"} <= set(header)
    # On a wide terminal: one table, one line per folder.
    wide = _cli("shards", "stats", run.url(run.run_dir), columns=240)
    assert len(_rows(wide, "iter-000001/")) == 2


def test_shards_ls_on_a_pipe_keeps_every_cell_whole(run):
    # Before: the `check` of a broken folder (what is wrong with which part) was cut to fit 80 columns.
    from storage.shards import read_manifest

    part = read_manifest(run.fs, run.stage_dir(1, "rollout")).parts[0]
    path = f"{run.stage_dir(1, 'rollout')}/{part.name}"
    run.fs.pipe_file(path, run.fs.cat_file(path)[:100])  # truncated to 100 bytes
    text = _cli("shards", "ls", run.url(run.run_dir), returncode=1)
    assert "…" not in text
    rows = _by_key(text, "iter-")
    assert rows["iter-000001/scored"][1:4] == ["scored", "1", "40"]
    assert rows["iter-000001/scored"][5:] == ["yes", "ok"]
    assert rows["iter-000001/rollout"][6] == f"broken: {part.name} truncated: 100 of {part.bytes:,} bytes"


def test_runs_show_on_a_pipe_prints_paths_whole_and_names_removed_checkpoints(run):
    # Before: the run folder's path cut at 80 columns, and "committed: no" for a checkpoint retention removed.
    from flows.records import record_metrics
    from storage.checkpoints import commit_checkpoint, save_checkpoint_files

    run.fs.pipe_file(run.config_path, b"run: {name: run-x}\n")
    for iteration in (1, 2, 3):
        local = run.root + f"/../local-{iteration}"
        os.makedirs(local, exist_ok=True)
        Path(local, "weights.bin").write_bytes(bytes([iteration]) * 8)
        save_checkpoint_files(run, iteration, local)
        commit_checkpoint(run, iteration, {"iteration": iteration}, keep_last=2)  # 3 commits, 2 kept: 1 removed
        record_metrics(run, {"iteration": iteration, "reward/mean": 0.25 * iteration, "timing/iteration": 1.5})
    record_metrics(run, {"iteration": 4, "reward/mean": 1.0, "timing/iteration": 1.5})  # a row with no commit
    write_json(run.fs, run.latest_path, {"iteration": 3})
    text = _cli("runs", "show", "run-x", "--root", run.root_url)
    assert f"run folder   {run.url(run.run_dir)}" in text.splitlines()
    states = {cells[0]: cells[-1] for cells in _rows(text, "") if re.fullmatch(r"\d+", cells[0])}
    assert states == {"1": "removed", "2": "committed", "3": "committed", "4": "no"}


def test_rescore_prints_its_command_whole_at_80_columns(run):
    # Before: "... train on from them: ppoflow train <root>/<fork>/config.yaml" at the end of one long line, wrapped
    # by the console's width in the middle of the path, so the command could not be copied.
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from flows.rescore import rescore_summary

    scored = SimpleNamespace(reward_mean=0.5, rows=64, cache_hits=0, uri=run.url(run.stage_dir(3, "scored")))
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(rescore_summary("run-x", "base", 3, 0.25, scored, run), highlight=False, crop=False)
    lines = console.file.getvalue().splitlines()
    assert f"train on       ppoflow train {run.url(run.config_path)}" in lines
    assert f"scored shards  {scored.uri}" in lines
    assert "reward/mean 0.2500 -> 0.5000" in console.file.getvalue()
