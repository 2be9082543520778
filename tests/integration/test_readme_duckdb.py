"""The duckdb examples of docs/storage.md ("Object storage and shards") run as written, offline: locally and on S3
(moto on loopback).

Each block is read from the page between its markers (tests/fixtures/docs.py) and executed; only the S3 endpoint
is pointed at the test server. The printed answers are checked against pyarrow's own reading of the same shards.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections import Counter

import pyarrow.compute as pc
import pytest

from storage import fs as fsutil
from storage.shards import read_shards, write_shards
from storage.synthetic import synthetic_table
from tests.fixtures.docs import named_block


def readme_block(name: str) -> str:
    block = named_block(name)
    assert block.file == "docs/storage.md" and block.lang == "python", block.where
    return block.text


def run_block(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/storage.md", "exec"), {})
    return out.getvalue()


def test_readme_duckdb_over_local_shards(tmp_path, monkeypatch):
    folder = tmp_path / "runs" / "demo" / "iter-000003" / "scored"
    fs, path = fsutil.resolve(str(folder))
    write_shards(
        fs, path, synthetic_table("scored", 300, seed=4, prompt_len=4, response_len=4), "scored", max_rows=128
    )  # three parts plus the manifest, which the dataset must skip
    monkeypatch.chdir(tmp_path)
    printed = run_block(readme_block("duckdb-local"))
    expected = read_shards(fs, path)
    [(samples, mean_reward)] = eval(printed)
    assert samples == 300
    assert mean_reward == pytest.approx(pc.mean(expected.column("reward")).as_py(), rel=1e-6)


def test_readme_duckdb_over_s3_shards(s3_server, s3_admin):
    import s3fs

    s3_admin.mkdir("my-bucket")
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": s3_server})
        path = "my-bucket/ppo/my-run/iter-000003/scored"
        write_shards(
            fs, path, synthetic_table("scored", 200, seed=5, prompt_len=4, response_len=4), "scored", max_rows=64
        )
        code = readme_block("duckdb-s3")
        assert 'endpoint_url="http://127.0.0.1:9000"' in code
        printed = run_block(code.replace("http://127.0.0.1:9000", s3_server))
        expected = Counter(read_shards(fs, path).column("finish_reason").to_pylist())
        assert dict(eval(printed)) == dict(expected) and sum(expected.values()) == 200
    finally:
        s3_admin.rm("my-bucket", recursive=True)
        s3_admin.invalidate_cache()
    assert "AWS_ACCESS_KEY_ID" in os.environ  # the page's "usual AWS_* variables" are what s3fs used
