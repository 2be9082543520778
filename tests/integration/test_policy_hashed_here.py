"""A rollout in the process whose warm trainer wrote the checkpoint loads its policy/ without hashing it again
(stages/policy.local_checkpoint_dir's hashed_here) on local storage; a copy fetched from S3 is still verified, and
so is every load without that trainer."""

from __future__ import annotations

import os

import pytest

import stages.rollout as rollout_stage
import storage.checkpoints as checkpoints
from engines import warm
from stages.checkpoint import run_checkpoint
from stages.manifests import PolicyRef
from stages.policy import local_policy_dir, policy_ref
from stages.rollout import run_rollout
from stages.score import run_score
from stages.update import run_update
from storage.checkpoints import CheckpointCorruptError, commit_checkpoint, save_checkpoint_files
from storage.layout import layout_for
from tests.integration.pipeline_helpers import small_config


def _committed_policy(cfg, tmp_path) -> PolicyRef:
    """Iteration 1's checkpoint: a policy/ of two files, committed to cfg's storage."""
    local = tmp_path / "staged"
    (local / "policy").mkdir(parents=True)
    (local / "policy" / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    (local / "policy" / "config.json").write_text('{"model_type": "llama"}')
    layout = layout_for(cfg)
    save_checkpoint_files(layout, 1, str(local))
    commit_checkpoint(layout, 1)
    return policy_ref(cfg, 2)


def _flip_a_byte(cfg) -> None:
    """The committed policy/model.safetensors with its first byte changed: same size, another sha256."""
    layout = layout_for(cfg)
    path = f"{layout.checkpoint_dir(1)}/policy/model.safetensors"
    data = bytearray(layout.fs.cat_file(path))
    data[0] ^= 0xFF
    layout.fs.pipe_file(path, bytes(data))


def test_only_a_local_checkpoint_hashed_here_is_used_unverified(storage_root, tmp_path, tiny_model_dir):
    root, storage = storage_root
    cfg = small_config(root, "hashed", tiny_model_dir, tmp_path / "data", storage=storage.model_dump())
    policy = _committed_policy(cfg, tmp_path)
    _flip_a_byte(cfg)  # before any load: on S3 a verified copy would be cached, and later loads would use it

    with pytest.raises(CheckpointCorruptError, match="model.safetensors"):
        local_policy_dir(cfg, policy)
    if root.startswith("s3://"):
        with pytest.raises(CheckpointCorruptError, match="model.safetensors"):  # a new transfer: verified
            local_policy_dir(cfg, policy, hashed_here=True)
    else:  # used in place, unread: the flipped byte is there
        folder = local_policy_dir(cfg, policy, hashed_here=True)
        with open(os.path.join(folder, "model.safetensors"), "rb") as f:
            assert f.read(1) == bytes([0 ^ 0xFF])


def test_a_rollout_beside_the_trainer_that_wrote_the_checkpoint_hashes_nothing(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    cfg = small_config(str(tmp_path / "runs"), "beside", tiny_model_dir, digits_dataset_dir, score={"cache": False})
    first = policy_ref(cfg, 1)
    run_checkpoint(cfg, 1, run_update(cfg, 1, first, run_score(cfg, 1, run_rollout(cfg, 1, first))))
    policy = policy_ref(cfg, 2)
    policy_files = [
        rel for rel in checkpoints.read_commit_marker(layout_for(cfg), 1)["files"] if rel.startswith("policy/")
    ]

    hashed: list[str] = []
    real_sha256 = checkpoints.file_sha256
    monkeypatch.setattr(checkpoints, "file_sha256", lambda path: hashed.append(path) or real_sha256(path))
    # An engine that cannot take weights in memory (vLLM, in its own process) loads the checkpoint's folder.
    monkeypatch.setattr(rollout_stage, "serve_in_memory", lambda *args, **kwargs: None)

    run_rollout(cfg, 2, policy)  # the warm trainer that saved iteration 1 is in this process
    assert hashed == []
    warm.invalidate(warm.Role.TRAINER)
    run_rollout(cfg, 2, policy)  # no such trainer: every policy file is verified
    assert sorted(os.path.relpath(p, layout_for(cfg).checkpoint_dir(1)) for p in hashed) == sorted(policy_files)
