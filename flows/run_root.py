"""Where a run is: its `run.root` made absolute when the run is created, and a run's saved config trained where
that run is.

A relative root (`./runs`, `rt`) means "under the folder I am in". Saved as typed in `<run>/config.yaml`, it made
`ppoflow train /abs/rt/fork/config.yaml`, run from another folder, start a new run under that folder's `rt`
instead of resuming the run whose config it is. So:

- `absolute_root(cfg)`: the config with `run.root` resolved against this process's working folder (an S3 root is
  kept). The training flow, `fork`, `rescore` and `train-rm` apply it before they write config.yaml, so every
  saved config names its run's root absolutely. A deployment's run resolves it in the flow run's working
  folder (where `prefect deploy` ran), as the README says for every relative path in a deploy-run config.
- `load_train_config(path, overrides)`: `ppoflow train CONFIG`'s config. When CONFIG is the saved config of an
  existing run (`<folder>/<run.name>/config.yaml` beside that run's run.json) and its root does not lead back to
  that folder, the run is not silently started again somewhere else:
  - a relative root (a config saved by a ppoflow before this check, or written by hand in the run's folder)
    resumes the run where the file is, and says so;
  - an absolute root that names another place is refused (ConfigError), naming both places and the `--set
    run.root=...` that resumes the run where the file is.
  `--set run.root=...` on the command line is obeyed as given (resolved to absolute), with no check.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from ppoflow.config import ConfigError, PPOFlowConfig, load_config
from storage.fs import absolute_url


def with_root(cfg: PPOFlowConfig, root: str) -> PPOFlowConfig:
    """`cfg` with run.root = `root` (a copy; `cfg` is left as it was)."""
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"root": root})})


def absolute_root(cfg: PPOFlowConfig) -> PPOFlowConfig:
    """`cfg` with a local run.root made absolute against this process's working folder (see the module
    docstring); the same object when it is absolute already or remote."""
    root = absolute_url(cfg.run.root)
    return cfg if root == cfg.run.root else with_root(cfg, root)


def saved_run_folder(config_path: str | Path, cfg: PPOFlowConfig) -> Optional[Path]:
    """The run folder whose saved config `config_path` is (`<folder>/<run.name>/config.yaml` beside a run.json),
    else None (a config written for new runs, kept anywhere)."""
    folder = Path(config_path).expanduser().resolve().parent
    if folder.name != cfg.run.name or not (folder / "run.json").is_file():
        return None
    return folder


def load_train_config(config_path: str | Path, overrides: Sequence[str] = ()) -> tuple[PPOFlowConfig, Optional[str]]:
    """`ppoflow train CONFIG [--set ...]`: the validated config with an absolute run.root, and a note to print
    when the run was found by where CONFIG is rather than by its run.root (see the module docstring).

    ConfigError as load_config raises it, and when CONFIG is an existing run's saved config whose absolute
    run.root names another place (the message names both places and the fix)."""
    cfg = load_config(config_path, list(overrides))
    root_given = any(item.split("=", 1)[0].strip() == "run.root" for item in overrides)
    saved = None if root_given else saved_run_folder(config_path, cfg)
    resolved = absolute_root(cfg)
    if saved is None:
        return resolved, None
    target = Path(resolved.run.root) / cfg.run.name
    if os.path.realpath(target) == str(saved):
        return resolved, None
    here = str(saved.parent)
    if not os.path.isabs(os.path.expanduser(cfg.run.root)) and not (target / "run.json").is_file():
        note = (
            f"run {cfg.run.name}: {config_path} is the saved config of the run at {saved}; its run.root "
            f"{cfg.run.root!r} would put the run at {target} from here, so the run resumes where its config is "
            f"(run.root={here})"
        )
        return with_root(cfg, here), note
    there = "another run of that name is there" if (target / "run.json").is_file() else "a new run would start there"
    raise ConfigError(
        f"{config_path} is the saved config of run {cfg.run.name!r} at {saved}, but its run.root={cfg.run.root!r} "
        f"puts the run at {target} ({there}). To resume the run at {saved}: ppoflow train {config_path} --set "
        f"run.root={here}; to train at {target} on purpose: --set run.root={resolved.run.root}"
    )
