"""Which policy weights an iteration starts from, as a PolicyRef, and where to find them locally.

Iteration i (1-based) samples and trains with the policy committed by iteration i-1; iteration 1 uses the
initial model folder (`model.policy_path`). `PolicyRef.weights_id` feeds the rollout and update cache keys,
so a different starting checkpoint can never reuse a stale result.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from ppoflow.fingerprint import folder_fingerprint, json_hash
from stages.manifests import PolicyRef
from storage import fs as fsutil
from storage.checkpoints import load_checkpoint, read_commit_marker
from storage.layout import layout_for


def checkpoint_weights_id(files: dict) -> str:
    """Identity of a checkpoint's files ({relative path: {"sha256", "bytes"}}), as staged and as committed."""
    return "ckpt-" + json_hash(files)


def initial_policy_ref(cfg) -> PolicyRef:
    """The initial model folder; FileNotFoundError naming model.policy_path when it holds no files."""
    path = os.path.abspath(cfg.model.policy_path)
    if not os.path.isdir(path) or not any(p.is_file() for p in os.scandir(path)):
        raise FileNotFoundError(
            f"model.policy_path={cfg.model.policy_path!r} holds no files (expected a Hugging Face model folder)"
        )
    return PolicyRef(
        version=0, checkpoint_iteration=None, uri=path, weights_id="initial-" + folder_fingerprint(path)[:20]
    )


def policy_ref(cfg, iteration: int) -> PolicyRef:
    """The policy iteration `iteration` starts from; RuntimeError when iteration-1 is not committed."""
    prev = iteration - 1
    if prev <= 0:
        return initial_policy_ref(cfg)
    layout = layout_for(cfg)
    marker = read_commit_marker(layout, prev)
    if marker is None:
        raise RuntimeError(
            f"iteration {iteration} needs the committed checkpoint of iteration {prev}, "
            f"but {layout.url(layout.checkpoint_dir(prev))} has no commit marker"
        )
    return PolicyRef(
        version=prev,
        checkpoint_iteration=prev,
        uri=layout.url(layout.checkpoint_dir(prev)),
        weights_id=checkpoint_weights_id(marker["files"]),
    )


def local_checkpoint_dir(
    cfg, ref: PolicyRef, parts: Optional[Sequence[str]] = None, hashed_here: bool = False
) -> Optional[str]:
    """A local folder holding policy/, critic/, trainer/ of the referenced checkpoint (None = initial model).

    parts: only those folders are fetched and verified (see storage.checkpoints.load_checkpoint).
    hashed_here: this process wrote or verified the checkpoint's files itself (its warm trainer holds exactly
    these weights: stages/update.py puts it back only after saving them, with their sha256 taken as they were
    written). On local storage they are then used in place without hashing them again; a copy fetched from
    remote storage is always verified, since the transfer is new.
    """
    if ref.checkpoint_iteration is None:
        return None
    layout = layout_for(cfg)
    verify = not (hashed_here and fsutil.is_local(layout.fs))
    return load_checkpoint(layout, ref.checkpoint_iteration, parts=parts, verify=verify)


def local_policy_dir(cfg, ref: PolicyRef, hashed_here: bool = False) -> str:
    """The referenced policy as a local Hugging Face folder; of a checkpoint only policy/ is fetched
    (hashed_here: see local_checkpoint_dir)."""
    ckpt = local_checkpoint_dir(cfg, ref, parts=("policy",), hashed_here=hashed_here)
    return ref.uri if ckpt is None else os.path.join(ckpt, "policy")


def behaviour_policy_ref(cfg, iteration: int) -> PolicyRef:
    """The policy iteration `iteration` samples with: the one committed at iteration-1-k (k =
    pipeline.max_staleness), the initial model before that; with k = 0 the policy it starts from.

    A fixed schedule, not "the newest checkpoint": the rollout's inputs, so its cache key and its samples,
    depend on the iteration alone, and a resumed pipelined run samples exactly what an uninterrupted one did."""
    return policy_ref(cfg, iteration - cfg.pipeline.max_staleness)
