"""`ppoflow runs repair RUN`: a corrupt latest checkpoint is quarantined and the next start recomputes it.

The check reads every file of the latest committed checkpoint against its commit marker (size, sha256).
A checkpoint that passes is left alone. One that fails moves to `<run>/quarantine/` (storage/repair.py),
and the run's persisted Prefect results are disowned (its results epoch moves on, storage/run_identity.py:
the stage cache keys hold it), wherever they persist (the run's folder, or Prefect's shared storage on warm
workers), so the next `ppoflow train` recomputes that iteration from the one before it instead of being
handed the manifest of a checkpoint that is gone (its rollout and score run again too).
"""

from __future__ import annotations

from ppoflow.config import StorageConfig
from storage.layout import RunLayout
from storage.repair import check_latest, quarantine
from storage.run_identity import disown_results


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
    disown_results(layout)  # no persisted stage result answers again, in-process or on a warm worker
    return (
        f"run {run}: checkpoint {latest} is corrupt ({error}); moved to {where}. Start the run again "
        f"(the same `ppoflow train` command) to recompute iteration {latest} from checkpoint {latest - 1}."
    )
