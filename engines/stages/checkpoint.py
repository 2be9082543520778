"""The checkpoint stage: commit the staged checkpoint (marker last), move LATEST, apply retention."""

from __future__ import annotations

import time

from engines.stages.manifests import CheckpointManifest, UpdateManifest, provenance
from storage.checkpoints import commit_checkpoint
from storage.layout import layout_for


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
        keep_last=cfg.run.keep_checkpoints,
    )
    return CheckpointManifest(
        iteration=iteration, uri=update.checkpoint_uri, weights_id=update.weights_id, **provenance(started)
    )
