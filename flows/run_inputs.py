"""A resume trains on what the run started with: the content of its model folders and data files is checked.

The config pins paths, not contents: a model folder swapped for another size or other weights, or a data file
whose rows were rewritten, used to resume silently and train on the new content (a new reference model, new
prompts) from the old checkpoint. At a run's first start `start_run` records a sha256 of each local input
(ppoflow/fingerprint.folder_fingerprint: every file directly in the folder, or the file) in `<run>/run.json`
(storage/run_identity.py); every later start compares and refuses a change before any work, naming the input,
the path and both hashes (until the run's first commit, a start records the contents it finds: nothing was trained
on the old ones yet). To continue on purpose: `ppoflow runs accept-inputs RUN --root ROOT` records the
current contents (the old hashes are kept under "accepted" in run.json).

Inputs: model.policy_path (weights, tokenizer, config), model.critic_path, data.path, eval.data_path, and the
folder of every reward source of kind `model`. Paths that are not local (s3://...) are not hashed here.
Cost: every byte read once per start (~1.5 s for SmolLM2-135M's 540 MB); a second start in the same process
reads nothing (folder_fingerprint's cache).
"""

from __future__ import annotations

import os
import time
from typing import Any

from ppoflow.config import ConfigError, PPOFlowConfig
from ppoflow.fingerprint import folder_fingerprint
from storage.layout import RunLayout
from storage.run_identity import new_run_record, read_run_record, write_run_record


class InputsChangedError(ConfigError):
    """A resumed run's model folder or data file holds other content than at the run's first start."""


def run_inputs(cfg: PPOFlowConfig) -> dict[str, str]:
    """Field -> local path of what the run reads (see the module docstring)."""
    inputs = {"model.policy_path": cfg.model.policy_path, "data.path": cfg.data.path}
    if cfg.algo.uses_critic and cfg.model.critic_path:
        inputs["model.critic_path"] = cfg.model.critic_path
    if cfg.eval.data_path:
        inputs["eval.data_path"] = cfg.eval.data_path
    for i, source in enumerate(cfg.reward.sources):
        if source.kind == "model":
            inputs[f"reward.sources[{i}].target"] = source.target
    return {field: path for field, path in inputs.items() if "://" not in path and os.path.exists(path)}


def fingerprint_inputs(cfg: PPOFlowConfig) -> dict[str, dict[str, str]]:
    return {
        field: {"path": os.path.abspath(path), "sha256": folder_fingerprint(path)}
        for field, path in run_inputs(cfg).items()
    }


def start_run(cfg: PPOFlowConfig, layout: RunLayout) -> dict[str, Any]:
    """The run's record: made at the first start (a new run id, the inputs' hashes), checked at every later one.

    Raises InputsChangedError naming each input whose content changed. An input the record lacks (a run from
    before this check, a record written by `runs repair`) is recorded now."""
    now = fingerprint_inputs(cfg)
    record = read_run_record(layout)
    if record is None:
        record = new_run_record(now)
        write_run_record(layout, record)
        return record
    recorded = record.setdefault("inputs", {})
    changed = [f for f in now if f in recorded and recorded[f]["sha256"] != now[f]["sha256"]]
    if changed and not layout.fs.exists(layout.latest_path):
        # No iteration committed: nothing was trained on the recorded contents; this start's are the run's.
        record["inputs"] = now
        write_run_record(layout, record)
        return record
    if changed:
        lines = [
            f"{field} ({now[field]['path']}): sha256 {recorded[field]['sha256'][:12]}... at the run's first start, "
            f"{now[field]['sha256'][:12]}... now"
            for field in changed
        ]
        raise InputsChangedError(
            f"run {cfg.run.name!r} was started with other content in its inputs than they hold now:\n  "
            + "\n  ".join(lines)
            + f"\nResuming would train the committed checkpoint on the new content. Restore the files, start a new "
            f"run (another run.name), or continue on purpose: ppoflow runs accept-inputs {cfg.run.name} --root "
            f"{cfg.run.root}"
        )
    if any(f not in recorded for f in now):
        recorded.update({f: v for f, v in now.items() if f not in recorded})
        write_run_record(layout, record)
    return record


def accept_inputs(cfg: PPOFlowConfig, layout: RunLayout) -> list[str]:
    """Record the inputs' current contents as the run's own; returns the fields whose hash changed."""
    record = read_run_record(layout)
    if record is None:
        raise FileNotFoundError(f"run {cfg.run.name!r} has no run record ({layout.url(layout.run_dir)}/run.json)")
    now = fingerprint_inputs(cfg)
    old = record.get("inputs", {})
    changed = [f for f in now if f in old and old[f]["sha256"] != now[f]["sha256"]]
    if changed:
        record.setdefault("accepted", []).append({"unix": time.time(), "previous": {f: old[f] for f in changed}})
    record["inputs"] = {**old, **now}
    write_run_record(layout, record)
    return changed


def accept_run_inputs(root: str, run: str, storage_cfg=None) -> str:
    """`ppoflow runs accept-inputs RUN --root ROOT`: accept_inputs for the run's saved config; returns a summary.
    FileNotFoundError when there is no such run."""
    import yaml

    from storage.layout import RunLayout

    layout = RunLayout(root, run, storage_cfg)
    if not layout.fs.exists(layout.config_path):
        raise FileNotFoundError(f"no run {run!r} under {root} (no {layout.url(layout.config_path)})")
    cfg = PPOFlowConfig.model_validate(yaml.safe_load(layout.fs.cat_file(layout.config_path).decode()))
    changed = accept_inputs(cfg, layout)
    if not changed:
        return f"run {run}: every input holds what the run recorded: nothing to accept"
    return f"run {run}: accepted the current contents of {', '.join(changed)}; the next start resumes on them"
