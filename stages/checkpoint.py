"""The checkpoint stage: commit the staged checkpoint (marker last), move LATEST, apply retention."""

from __future__ import annotations

import time

from stages.manifests import CheckpointManifest, UpdateManifest, provenance
from storage.checkpoints import commit_checkpoint
from storage.layout import layout_for


def checkpoints_to_keep(cfg) -> int:
    """run.keep_checkpoints, raised to k+1 under pipeline.max_staleness = k: iteration i samples with the
    checkpoint of i-1-k, and iterations up to i-1 may commit before its rollout loads it, so the newest k+1
    must stay (with k = 2 and 2 kept, iteration 11 found checkpoint 8 removed: bench.async)."""
    return max(cfg.run.keep_checkpoints, cfg.pipeline.max_staleness + 1)


def run_checkpoint(cfg, iteration: int, update: UpdateManifest) -> CheckpointManifest:
    """Commit iteration `iteration`'s staged checkpoint. Idempotent: a committed one is left as it is.

    The trainer the update put back in the warm registry is keyed by the staged files' identity, which is
    the committed checkpoint's PolicyRef.weights_id: the next iteration finds it without any re-tagging.
    """
    started = time.perf_counter()
    commit_checkpoint(
        layout_for(cfg),
        iteration,
        {"iteration": iteration, "metrics": update.metrics, "weights_id": update.weights_id},
        keep_last=checkpoints_to_keep(cfg),
    )
    return CheckpointManifest(
        iteration=iteration, uri=update.checkpoint_uri, weights_id=update.weights_id, **provenance(started)
    )
