"""Shards describe themselves (schema metadata on every part) and `shards ls` reports a truncated part."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from ppoflow.config import PPOFlowConfig
from storage import fs as fsutil
from storage.shards import read_shards, shard_metadata, write_shards
from storage.synthetic import synthetic_table

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_every_part_carries_run_iteration_stage_config_hash_and_version(tmp_path):
    cfg = PPOFlowConfig.model_validate({"run": {"name": "meta-run", "root": str(tmp_path)}})
    fs, folder = fsutil.resolve(str(tmp_path / "meta-run" / "iter-000007" / "scored"))
    table = synthetic_table("scored", 50, prompt_len=4, response_len=4)
    manifest = write_shards(fs, folder, table, "scored", max_rows=20, metadata=shard_metadata(cfg, 7, "score"))
    assert len(manifest.parts) == 3  # 50 rows in parts of at most 20: the metadata is on each of them
    # Expected hash derived here independently of storage.layout: sha256 of the sorted-keys JSON of the
    # resolved config (as config.yaml holds it), first 16 hex digits.
    saved = yaml.safe_load(cfg.to_yaml())
    expected_hash = hashlib.sha256(json.dumps(saved, sort_keys=True, default=str).encode()).hexdigest()[:16]
    for part in manifest.parts:
        # A part read alone, with pyarrow only (as a user with a copied file would).
        with pa.memory_map(os.path.join(folder, part.name)) as source:
            meta = pa.ipc.open_file(source).schema.metadata
        meta = {k.decode(): v.decode() for k, v in meta.items()}
        assert meta["ppoflow.run"] == "meta-run"
        assert meta["ppoflow.iteration"] == "7"
        assert meta["ppoflow.stage"] == "score"
        assert meta["ppoflow.kind"] == "scored"
        assert meta["ppoflow.schema_version"] == "1"
        assert meta["ppoflow.config_hash"] == expected_hash
        assert meta["ppoflow.version"]
    # The verified reader still reads the parts (metadata is not part of the schema check) and the rows.
    assert read_shards(fs, folder).num_rows == 50
    # `shards show` prints the metadata under its table.
    from rich.console import Console

    from storage.inspect import shards_show

    console = Console(record=True, width=200)
    console.print(shards_show(folder, rows=2, columns=["reward"]))
    shown = console.export_text()
    assert "run=meta-run" in shown and "iteration=7" in shown and f"config_hash={expected_hash}" in shown


def test_metadata_keys_must_carry_the_prefix(tmp_path):
    fs, folder = fsutil.resolve(str(tmp_path / "s"))
    with pytest.raises(ValueError, match="must be strings starting with 'ppoflow.'"):
        write_shards(fs, folder, synthetic_table("rollout", 2), "rollout", metadata={"run": "x"})
    assert not os.path.exists(folder)  # refused before anything was written


def test_shards_ls_reports_a_truncated_part_as_broken(tmp_path):
    fs, run = fsutil.resolve(str(tmp_path / "r"))
    good, bad = fsutil.join(run, "iter-000001", "rollout"), fsutil.join(run, "iter-000001", "scored")
    write_shards(fs, good, synthetic_table("rollout", 30, prompt_len=4, response_len=4), "rollout")
    manifest = write_shards(fs, bad, synthetic_table("scored", 30, prompt_len=4, response_len=4), "scored", max_rows=10)
    victim = os.path.join(bad, manifest.parts[1].name)
    with open(victim, "r+b") as f:
        f.truncate(manifest.parts[1].bytes - 100)
    result = _cli("shards", "ls", run, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    scored_line = next(line for line in lines if "iter-000001/scored" in line)
    rollout_line = next(line for line in lines if "iter-000001/rollout" in line)
    assert "broken" in scored_line and manifest.parts[1].name in scored_line and "truncated" in scored_line
    assert f"{manifest.parts[1].bytes - 100:,} of {manifest.parts[1].bytes:,} bytes" in scored_line
    assert "ok" in rollout_line and "broken" not in rollout_line
    assert "error:" in result.stderr and "Traceback" not in result.stderr


def test_runs_ls_takes_the_root_as_positional(tmp_path):
    """`ppoflow runs ls ROOT` lists the runs under ROOT (the parser used to take ROOT as a run name)."""
    for name, rows in (("alpha", [0.25, 0.5]), ("beta", [0.125])):
        run = tmp_path / "root" / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("run: {}\n")
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps({"iteration": i + 1, "reward/mean": r}) + "\n" for i, r in enumerate(rows))
        )
    elsewhere = tmp_path / "elsewhere"  # cwd without ./runs: only the positional can find the runs
    elsewhere.mkdir()
    result = _cli("runs", "ls", str(tmp_path / "root"), cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    alpha = next(line for line in result.stdout.splitlines() if "alpha" in line)
    beta = next(line for line in result.stdout.splitlines() if "beta" in line)
    assert "0.500" in alpha and " 2 " in alpha  # last reward, rows logged
    assert "0.125" in beta
