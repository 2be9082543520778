"""The commands an S3 run prints at its end (`plot:`, `inspect:`), run as printed against the moto server, and
`ppoflow shards|runs` on a bucket that is missing or an endpoint that does not answer: one `ppoflow: error:`
line naming the URL and the endpoint, no traceback. Each command is the installed `ppoflow` script in a
subprocess, as a user types it."""

from __future__ import annotations

import io
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from ppoflow.config import load_config
from storage.layout import layout_for
from storage.shards import write_shards
from storage.synthetic import synthetic_table

PPOFLOW = Path(sys.executable).parent / "ppoflow"


def _ppoflow(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # The AWS_* test credentials are in this process's environment (tests/fixtures/s3.py): inherited.
    env = {**os.environ, "COLUMNS": "240"}  # rich wraps at 80 columns when piped
    return subprocess.run([str(PPOFLOW), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_the_commands_an_s3_run_prints_work_as_printed(s3_bucket, tmp_path):
    from flows.records import record_metrics
    from flows.run import _print_where

    bucket, storage_cfg = s3_bucket
    cfg = load_config(
        None,
        [
            f"run.root=s3://{bucket}/runs",
            "run.name=s3run",
            "run.iterations=2",
            f"storage.endpoint_url={storage_cfg.endpoint_url}",
        ],
    )
    # What a finished 2-iteration run leaves that these commands read: config.yaml, metrics.jsonl, the last
    # iteration's scored shards.
    layout = layout_for(cfg)
    layout.write_config_once(cfg.to_yaml(), defaults=type(cfg)().model_dump(mode="json"))
    for iteration, reward in ((1, 0.25), (2, 0.75)):
        record_metrics(layout, {"iteration": iteration, "reward/mean": reward, "timing/iteration": 1.0})
    scored = synthetic_table("scored", 24, seed=5, iteration=2)
    write_shards(layout.fs, layout.stage_dir(2, "scored"), scored, "scored")

    console = Console(file=io.StringIO(), width=400, color_system=None)
    _print_where(cfg, console)
    printed = dict(line.split(":", 1) for line in console.file.getvalue().splitlines())
    plot, stats = shlex.split(printed["plot"]), shlex.split(printed["inspect"])
    assert plot[:3] == ["ppoflow", "runs", "plot"] and stats[:3] == ["ppoflow", "shards", "stats"]

    out = _ppoflow(stats[1:], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "iter-000002/scored" in out.stdout
    (row,) = [[c.strip() for c in line.split("│")[1:-1]] for line in out.stdout.splitlines() if "│ scored" in line]
    reward_mean = scored.column("reward").to_numpy().astype(np.float64).mean()
    assert row[1:3] == ["scored", "24"] and row[5].startswith(f"{reward_mean:.3g}±"), row

    out = _ppoflow(plot[1:], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["wrote", "s3run-metrics.png"]
    assert (tmp_path / "s3run-metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case", ["endpoint that does not answer", "missing bucket", "missing folder"])
def test_a_storage_error_is_one_line_naming_the_url_and_the_endpoint(case, s3_bucket, tmp_path):
    bucket, storage_cfg = s3_bucket
    endpoint = storage_cfg.endpoint_url
    if case == "endpoint that does not answer":
        endpoint = f"http://127.0.0.1:{_closed_port()}"
        url = f"s3://{bucket}/runs/s3run/iter-000002/scored"
        argv, expected = ["shards", "stats", url, "--endpoint-url", endpoint], f"cannot reach bucket '{bucket}'"
    elif case == "missing bucket":
        url = "s3://no-such-bucket/runs"
        argv, expected = ["runs", "ls", url, "--endpoint-url", endpoint], "bucket 'no-such-bucket' does not exist"
    else:
        url = f"s3://{bucket}/runs"
        argv, expected = ["runs", "show", "nope", "--root", url, "--endpoint-url", endpoint], "FileNotFoundError"

    out = _ppoflow(argv, tmp_path)

    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"ppoflow: error: {url}: ") and endpoint in line and expected in line, line
