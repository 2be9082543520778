"""The checkpoint stage commits only the files the update it is handed staged: a checkpoint restaged since (another
attempt of the update) is refused with nothing committed, and the handed attempt's own files commit."""

from __future__ import annotations

import hashlib

import pytest

from ppoflow.config import load_config
from stages.checkpoint import run_checkpoint
from stages.manifests import UpdateManifest
from stages.policy import checkpoint_weights_id
from storage.checkpoints import (
    CheckpointError,
    is_committed,
    latest_iteration,
    read_commit_marker,
    save_checkpoint_files,
)
from storage.layout import layout_for


def _stage(layout, tmp_path, name: str, payload: bytes) -> UpdateManifest:
    """One attempt of iteration 1's update: stage `payload` as the policy's weights; its manifest."""
    folder = tmp_path / name / "policy"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(payload)
    staged = save_checkpoint_files(layout, 1, str(tmp_path / name))
    return UpdateManifest(
        iteration=1,
        seconds=1.0,
        worker="test:1",
        engine_builds=0,
        checkpoint_uri=layout.url(layout.checkpoint_dir(1)),
        experience_uri="unused",
        weights_id=checkpoint_weights_id(staged["files"]),
        experience_hash="unused",
        metrics={"reward/mean": 0.5},
    )


def test_a_checkpoint_restaged_by_another_attempt_is_refused_and_the_handed_one_commits(tmp_path):
    cfg = load_config(None, [f"run.root={tmp_path / 'runs'}", "run.name=ck"])
    layout = layout_for(cfg)
    first = _stage(layout, tmp_path, "a", b"weights of attempt A")
    second = _stage(layout, tmp_path, "b", b"weights of attempt B, restaged")  # replaces A's staged files
    assert first.weights_id != second.weights_id
    with pytest.raises(CheckpointError, match=rf"iteration 1: .* is ckpt-\w+, not {first.weights_id}"):
        run_checkpoint(cfg, 1, first)
    assert not is_committed(layout, 1) and latest_iteration(layout) is None  # nothing written
    run_checkpoint(cfg, 1, second)
    marker = read_commit_marker(layout, 1)
    expected = hashlib.sha256(b"weights of attempt B, restaged").hexdigest()
    assert marker["files"]["policy/model.safetensors"]["sha256"] == expected
    assert marker["meta"]["weights_id"] == second.weights_id and latest_iteration(layout) == 1
    run_checkpoint(cfg, 1, second)  # idempotent
