"""`ppoflow shards ls|show|stats` renderers over a run folder, locally and on the moto S3 server."""

from __future__ import annotations

import io

import numpy as np
import pytest
from rich.console import Console

from storage.inspect import shards_ls, shards_show, shards_stats, stage_stats
from storage.layout import RunLayout
from storage.shards import NotCommittedError, write_shards
from storage.synthetic import synthetic_table


def render(renderable) -> str:
    console = Console(file=io.StringIO(), width=240, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def table_cells(line: str) -> list[str]:
    """The cells of one body row of a rendered rich table; [] for borders and headers."""
    cells = [c.strip() for c in line.split("│")[1:-1]]
    return cells if cells and cells[0].startswith("iter-") else []


@pytest.fixture
def run(storage_root):
    """Iteration 1: rollout + scored committed; iteration 2: rollout parts without a manifest."""
    root, cfg = storage_root
    layout = RunLayout(root, "run-x", cfg)
    rollout = synthetic_table("rollout", 40, seed=21)
    scored = synthetic_table("scored", 40, seed=22)
    write_shards(layout.fs, layout.stage_dir(1, "rollout"), rollout, "rollout", max_rows=15)
    write_shards(layout.fs, layout.stage_dir(1, "scored"), scored, "scored")
    write_shards(layout.fs, layout.stage_dir(2, "rollout"), rollout, "rollout")
    layout.fs.rm_file(f"{layout.stage_dir(2, 'rollout')}/_manifest.json")
    return layout, rollout, scored


def test_ls_lists_committed_and_uncommitted_folders(run):
    layout, _, _ = run
    text = render(shards_ls(layout.url(layout.run_dir), layout.storage_cfg))
    rows = {cells[0]: cells for cells in map(table_cells, text.splitlines()) if cells}
    assert set(rows) == {"iter-000001/rollout", "iter-000001/scored", "iter-000002/rollout"}
    # folder, kind, parts, rows, bytes, committed; 40 rows at <= 15 per part: 3 parts.
    assert rows["iter-000001/rollout"][1:4] == ["rollout", "3", "40"]
    assert rows["iter-000001/scored"][5] == "yes" and rows["iter-000002/rollout"][5] == "no"


def test_show_prints_first_rows_of_chosen_columns(run):
    layout, rollout, _ = run
    text = render(
        shards_show(
            layout.url(layout.stage_dir(1, "rollout")),
            rows=3,
            columns=["sample_index", "prompt_hash"],
            storage_cfg=layout.storage_cfg,
        )
    )
    assert "first 3 of 40 rows" in text
    for value in rollout.column("prompt_hash").to_pylist()[:3]:
        assert value[:20] in text
    assert "response_ids" not in text
    with pytest.raises(ValueError, match="holds 3 stage folders"):
        shards_show(layout.url(layout.run_dir), storage_cfg=layout.storage_cfg)
    with pytest.raises(NotCommittedError):
        shards_show(layout.url(layout.stage_dir(2, "rollout")), storage_cfg=layout.storage_cfg)


def test_stats_match_numpy(run):
    layout, rollout, scored = run
    stats = stage_stats(layout.fs, layout.stage_dir(1, "scored"))
    reward = scored.column("reward").to_numpy()
    lengths = np.array([len(r) for r in scored.column("response_ids").to_pylist()])
    assert stats["rows"] == 40
    assert stats["reward"]["mean"] == pytest.approx(reward.mean(), rel=1e-6)  # float32 data, float64 sums
    assert stats["reward"]["std"] == pytest.approx(reward.std(), rel=1e-5)
    assert stats["reward"]["q50"] == pytest.approx(np.quantile(reward, 0.5), rel=1e-6)
    assert stats["response_len"] == {"mean": pytest.approx(lengths.mean()), "max": int(lengths.max())}
    finish = scored.column("finish_reason").to_pylist()
    assert stats["finish_reasons"] == {r: finish.count(r) for r in set(finish)}
    text = render(shards_stats(layout.url(layout.iteration_dir(1)), layout.storage_cfg))
    assert "rollout" in text and "scored" in text and f"{reward.mean():.3g}" in text


def test_unknown_uri_is_a_clear_error(run):
    layout, _, _ = run
    with pytest.raises(FileNotFoundError, match="no shards under"):
        shards_ls(layout.url(layout.iteration_dir(9)), layout.storage_cfg)
