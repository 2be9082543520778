"""`ppoflow runs repair RUN`: a corrupt latest checkpoint is quarantined and the next start recomputes it.

The check reads every file of the latest committed checkpoint against its commit marker (size, sha256).
A checkpoint that passes is left alone. One that fails moves to `<run>/quarantine/` (storage/repair.py),
and the persisted Prefect results of its update and checkpoint stages are forgotten, so the next
`ppoflow train` recomputes that iteration from the one before it (rollout and score come back from cache:
their shards are intact) instead of being handed the manifest of a checkpoint that is gone.
"""

from __future__ import annotations

from ppoflow.config import StorageConfig
from storage.layout import RunLayout
from storage.repair import check_latest, quarantine
from tasks.cache_keys import forget_stage_results


def repair_run(root: str, run: str, storage_cfg: StorageConfig | None = None) -> str:
    """Check the run's latest checkpoint and quarantine it when corrupt; returns what was done, in words.
    FileNotFoundError when there is no such run."""
    layout = RunLayout(root, run, storage_cfg)
    if not layout.fs.exists(layout.config_path):
        raise FileNotFoundError(f"no run {run!r} under {root} (no {layout.url(layout.config_path)})")
    latest, error = check_latest(layout)
    if latest is None:
        return f"run {run}: nothing committed yet, nothing to repair"
    if error is None:
        return f"run {run}: checkpoint {latest} verifies (every file's size and sha256): nothing to repair"
    where = quarantine(layout, latest)
    forget_stage_results(layout, latest, ("update", "checkpoint"))
    return (
        f"run {run}: checkpoint {latest} is corrupt ({error}); moved to {where}. Start the run again "
        f"(the same `ppoflow train` command) to recompute iteration {latest} from checkpoint {latest - 1}."
    )
