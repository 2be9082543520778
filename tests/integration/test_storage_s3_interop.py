"""Shards open with the tools people already use: pyarrow.ipc, pyarrow.dataset and `datasets`, locally and on S3.

The parts are Arrow IPC *file* format: pyarrow.dataset's "arrow" format needs it, and
datasets.load_dataset("arrow", ...) reads it (it tries the stream format, then the file format).
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from storage.layout import RunLayout
from storage.shards import write_shards
from storage.synthetic import synthetic_table


@pytest.fixture
def written(storage_root):
    root, cfg = storage_root
    layout = RunLayout(root, "run-i", cfg)
    table = synthetic_table("scored", 120, seed=11)
    stage = layout.stage_dir(1, "scored")
    manifest = write_shards(layout.fs, stage, table, "scored", max_rows=50)
    part_paths = [f"{stage}/{p.name}" for p in manifest.parts]
    return layout, table, part_paths


def test_pyarrow_ipc_opens_each_part(written):
    layout, table, part_paths = written
    pieces = []
    for path in part_paths:
        with layout.fs.open(path, "rb") as f:
            pieces.append(pa.ipc.open_file(f).read_all())
    assert pa.concat_tables(pieces).equals(table)


def test_pyarrow_dataset_reads_the_parts(written):
    layout, table, part_paths = written
    dataset = ds.dataset(part_paths, format="arrow", filesystem=layout.fs)
    assert dataset.to_table().equals(table)
    chosen = dataset.to_table(columns=["prompt_index", "reward"], filter=ds.field("sample_index") == 0)
    expected = table.filter(pa.compute.equal(table["sample_index"], 0)).select(["prompt_index", "reward"])
    assert chosen.equals(expected)


@pytest.mark.slow
def test_datasets_load_dataset_arrow(written, tmp_path, monkeypatch):
    import datasets

    # datasets' offline mode (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, often set in CI) refuses every
    # remote URL, s3:// included; the S3 server here is on loopback, so lift it for this test.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)

    layout, table, part_paths = written
    urls = [layout.url(p) for p in part_paths]
    options = None
    if urls[0].startswith("s3://"):
        options = {
            "client_kwargs": {"endpoint_url": layout.storage_cfg.endpoint_url},
            "key": os.environ["AWS_ACCESS_KEY_ID"],
            "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "token": os.environ.get("AWS_SESSION_TOKEN"),
        }
    loaded = datasets.load_dataset(
        "arrow",
        data_files={"train": urls},
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
        storage_options=options,
    )
    assert loaded.num_rows == table.num_rows
    assert loaded["response_ids"] == table.column("response_ids").to_pylist()
    assert loaded["reward"] == table.column("reward").to_pylist()
