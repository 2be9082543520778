"""Which policy weights an iteration starts from, as a small JSON reference.

Iteration i (1-based) samples with the policy committed by iteration i-1; iteration 1 uses the initial
model folder (`model.policy_path`). The reference's `content_hash` feeds the rollout and update cache
keys, so a different starting checkpoint can never reuse a stale result.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from ppoflow.config import PPOFlowConfig
from storage.checkpoints import load_checkpoint, read_commit_marker
from tasks.common import layout_for, stable_hash


def _folder_fingerprint(path: str) -> str:
    """Names, sizes and mtimes of a local model folder: cheap, and changes when the weights are rewritten."""
    entries = []
    for p in sorted(Path(path).glob("*")):
        if p.is_file():
            st = p.stat()
            entries.append((p.name, st.st_size, int(st.st_mtime)))
    if not entries:
        raise FileNotFoundError(f"model.policy_path={path!r} holds no files (expected a Hugging Face model folder)")
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:20]


def policy_ref(cfg: PPOFlowConfig, iteration: int) -> dict[str, Any]:
    """{"version", "checkpoint_iteration" (None = initial model), "uri", "content_hash"} for `iteration`."""
    prev = iteration - 1
    if prev <= 0:
        path = os.path.abspath(cfg.model.policy_path)
        return {"version": 0, "checkpoint_iteration": None, "uri": path,
                "content_hash": "initial-" + _folder_fingerprint(path)}
    layout = layout_for(cfg)
    marker = read_commit_marker(layout, prev)
    if marker is None:
        raise RuntimeError(f"iteration {iteration} needs the committed checkpoint of iteration {prev}, "
                           f"but {layout.url(layout.checkpoint_dir(prev))} has no commit marker")
    return {"version": prev, "checkpoint_iteration": prev, "uri": layout.url(layout.checkpoint_dir(prev)),
            "content_hash": stable_hash(marker)}


def local_checkpoint_dir(cfg: PPOFlowConfig, ref: dict[str, Any], parts: Optional[Sequence[str]] = None) -> str | None:
    """A local folder holding policy/, critic/, trainer/ of the referenced checkpoint (None = initial).

    parts: only those folders are fetched and verified (see storage.checkpoints.load_checkpoint).
    """
    if ref["checkpoint_iteration"] is None:
        return None
    return load_checkpoint(layout_for(cfg), ref["checkpoint_iteration"], parts=parts)


def local_policy_dir(cfg: PPOFlowConfig, ref: dict[str, Any]) -> str:
    """The referenced policy as a local Hugging Face folder; of a checkpoint only policy/ is fetched and verified."""
    ckpt = local_checkpoint_dir(cfg, ref, parts=("policy",))
    return ref["uri"] if ckpt is None else os.path.join(ckpt, "policy")
