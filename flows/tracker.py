"""Experiment trackers fed with each iteration's metrics row: TensorBoard always, wandb / MLflow when set up.

TensorBoard: event files under `<run>/tensorboard/`, one scalar per numeric key of the row under the
same name as in metrics.jsonl (`reward/mean`, `timing/rollout`, ...), step = iteration. Written with
`torch.utils.tensorboard.SummaryWriter` (the `tensorboard` package's event format).
- Resume: each process starts a new event file whose first event is a SessionLog START at the first
  step it writes (SummaryWriter's `purge_step`). TensorBoard's readers then drop the points at that step
  and later from earlier files, so an iteration written again (a resumed or retried run) shows once.
  The same happens inside one process when a step comes again (a new writer with purge_step).
- Object storage: the writer appends to a local file, which S3 cannot do, so the event files live in a
  local mirror, `<local cache>/mirror/<root as a folder name>/<run>/tensorboard/` (flows/logs.py), and the
  current event file is copied whole to `<run>/tensorboard/` in the bucket after every row. A writer
  starts a new file every 100 rows (a row is ~1.6 KB with the default metrics), so a copy stays under
  ~200 KB however long the run. `tensorboard --logdir` may point at either folder.

wandb / MLflow (optional, never installed by ppoflow): rows go to `wandb.log(row, step=iteration)` when
`wandb` imports and WANDB_PROJECT is set, and to `mlflow.log_metrics(row, step=iteration)` when `mlflow`
imports and MLFLOW_TRACKING_URI is set. Metric names there drop no character; MLflow's allowed set
includes "/".

Forks (flows/fork.py): a fork's event files hold its parent's row at the fork point N (step N) before its own
N+1.., so `tensorboard --logdir <root>` draws the fork's curve from where it left the parent's (each run is the
folder `<run>/tensorboard`). Its metrics.jsonl holds its own rows only.

Tracker failures never fail an iteration: metrics.jsonl is the record; a tracker is a view of it.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Optional

from storage.layout import RunLayout

log = logging.getLogger("ppoflow.tracker")


def numeric_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric metrics (bools and strings left out, "iteration" is the step, not a metric)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _remote(layout: RunLayout) -> bool:
    from storage.fs import is_local

    return not is_local(layout.fs)


def tensorboard_dir_for(layout: RunLayout) -> str:
    """Where the event files are written: `<run>/tensorboard` locally, the local mirror for object storage."""
    if not _remote(layout):
        return os.path.join(layout.run_dir, "tensorboard")
    from storage.run_logs import mirror_dir

    return os.path.join(mirror_dir(layout.root_url, layout.run_name, layout.storage_cfg.local_cache_dir), "tensorboard")


_ROWS_PER_FILE = 100  # a new event file every 100 rows: on S3 each upload copies one small file whole


class TensorBoardTracker:
    """One SummaryWriter at a time per run and process; see the module docstring for resume and S3."""

    def __init__(self, layout: RunLayout):
        self.layout = layout
        self.logdir = tensorboard_dir_for(layout)
        self._writer = None
        self._file: Optional[str] = None  # the current event file's name
        self._rows_in_file = 0
        self._last_step: Optional[int] = None

    def _open(self, purge_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter

        if self._writer is not None:
            self._writer.close()
        os.makedirs(self.logdir, exist_ok=True)
        before = set(os.listdir(self.logdir))
        # A new file per writer; purge_step makes readers drop earlier points at that step and after.
        self._writer = SummaryWriter(log_dir=self.logdir, purge_step=purge_step)
        made = sorted(set(os.listdir(self.logdir)) - before)
        self._file = made[-1] if made else None
        self._rows_in_file = 0
        return self._writer

    def fork_point(self, step: int) -> Optional[tuple[int, dict[str, float]]]:
        """(N, the parent's metrics at N) when `step` is this fork's first own iteration N+1, else None."""
        from storage import lineage
        from storage.metrics import read_metrics
        from storage.run_identity import read_run_record

        parent = lineage.parent_of(read_run_record(self.layout))
        if parent is None or step != int(parent["iteration"]) + 1:
            return None
        rows = read_metrics(RunLayout(parent["root"], parent["run"], self.layout.storage_cfg))
        found = [row for row in rows if row.get("iteration") == step - 1]
        return (step - 1, numeric_metrics(found[0])) if found else None

    def log_row(self, step: int, metrics: dict[str, float]) -> None:
        if self._last_step is None and (lead := self.fork_point(step)) is not None:
            self._log(*lead)  # a new process's first row is the fork's first: its curve starts at the parent's
        self._log(step, metrics)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        writer = self._writer
        if writer is None or self._last_step is None or step <= self._last_step:
            writer = self._open(purge_step=step)  # a new process, or a step written again
        elif self._rows_in_file >= _ROWS_PER_FILE:
            writer = self._open(purge_step=None)  # steps go on: nothing to purge
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)
        writer.flush()
        self._rows_in_file += 1
        self._last_step = step
        if _remote(self.layout) and self._file:
            self._upload(self._file)

    def _upload(self, name: str) -> None:
        """Copy the current event file whole (earlier files were copied after their last row)."""
        from storage import fs as fsutil

        remote = fsutil.join(self.layout.run_dir, "tensorboard", name)
        fsutil.upload_file_atomic(self.layout.fs, os.path.join(self.logdir, name), remote)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class _OptionalTrackers:
    """wandb and MLflow, each only when importable and configured by its own environment variable."""

    def __init__(self, layout: RunLayout):
        self.wandb = self.mlflow = None
        if os.environ.get("WANDB_PROJECT"):
            try:
                import wandb  # noqa: F401 - optional

                self.wandb = wandb
                if wandb.run is None:
                    wandb.init(
                        project=os.environ["WANDB_PROJECT"],
                        name=layout.run_name,
                        resume="allow",
                        id=f"ppoflow-{layout.run_name}",
                    )
            except ImportError:
                log.info("WANDB_PROJECT is set but wandb is not installed; not logging to wandb")
        if os.environ.get("MLFLOW_TRACKING_URI"):
            try:
                import mlflow  # noqa: F401 - optional

                self.mlflow = mlflow
                if mlflow.active_run() is None:
                    mlflow.set_experiment(layout.run_name)
                    mlflow.start_run(run_name=layout.run_name)
            except ImportError:
                log.info("MLFLOW_TRACKING_URI is set but mlflow is not installed; not logging to MLflow")

    def log_row(self, step: int, metrics: dict[str, float]) -> None:
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)


_TRACKERS: dict[str, tuple[TensorBoardTracker, _OptionalTrackers]] = {}


def track_row(layout: RunLayout, row: dict[str, Any]) -> None:
    """Send one metrics row (with "iteration") to every tracker of the run; failures are logged, not raised."""
    key = layout.url(layout.run_dir)
    try:
        if key not in _TRACKERS:
            _TRACKERS[key] = (TensorBoardTracker(layout), _OptionalTrackers(layout))
        step, metrics = int(row["iteration"]), numeric_metrics(row)
        for tracker in _TRACKERS[key]:
            tracker.log_row(step, metrics)
    except Exception as e:  # noqa: BLE001 - see the module docstring
        log.warning("tracker for %s failed at iteration %s: %s: %s", key, row.get("iteration"), type(e).__name__, e)


def close_trackers() -> None:
    for tensorboard, _ in _TRACKERS.values():
        tensorboard.close()
    _TRACKERS.clear()
