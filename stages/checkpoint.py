"""The checkpoint stage: commit the staged checkpoint (marker last), move LATEST, apply retention."""

from __future__ import annotations

import time

from stages.manifests import CheckpointManifest, UpdateManifest, provenance
from stages.policy import checkpoint_weights_id
from storage.checkpoints import CheckpointError, commit_checkpoint
from storage.layout import layout_for


def checkpoints_to_keep(cfg) -> int:
    """run.keep_checkpoints, raised to k+1 under pipeline.max_staleness = k: iteration i samples with the
    checkpoint of i-1-k, and iterations up to i-1 may commit before its rollout loads it, so the newest k+1
    must stay (with k = 2 and 2 kept, iteration 11 found checkpoint 8 removed: bench.async)."""
    return max(cfg.run.keep_checkpoints, cfg.pipeline.max_staleness + 1)


def run_checkpoint(cfg, iteration: int, update: UpdateManifest) -> CheckpointManifest:
    """Commit iteration `iteration`'s staged checkpoint. Idempotent: a committed one is left as it is.

    Raises CheckpointError, committing nothing, when the staged files are not the ones `update` staged (their
    identity is not update.weights_id), or when nothing (or a damaged set of files) is staged.

    The trainer the update put back in the warm registry is keyed by the staged files' identity, which is
    the committed checkpoint's PolicyRef.weights_id: the next iteration finds it without any re-tagging.
    """
    started = time.perf_counter()
    layout = layout_for(cfg)

    def staged_by_this_update(files: dict) -> None:
        # The files staged now must be the ones the handed update staged (their identity is its weights_id):
        # otherwise another attempt of the update restaged the iteration since, and committing would pair these
        # files with the other attempt's metrics and warm trainer.
        staged_id = checkpoint_weights_id(files)
        if staged_id != update.weights_id:
            raise CheckpointError(
                f"cannot commit iteration {iteration}: the checkpoint staged at "
                f"{layout.url(layout.checkpoint_dir(iteration))} is {staged_id}, not {update.weights_id}, the one "
                f"the update stage handed over (another attempt of the update restaged it since); nothing was "
                f"committed: rerun the iteration's update"
            )

    commit_checkpoint(
        layout,
        iteration,
        {"iteration": iteration, "metrics": update.metrics, "weights_id": update.weights_id},
        keep_last=checkpoints_to_keep(cfg),
        verify_staged=staged_by_this_update,
    )
    return CheckpointManifest(
        iteration=iteration, uri=update.checkpoint_uri, weights_id=update.weights_id, **provenance(started)
    )
