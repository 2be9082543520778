"""Where everything of a run lives, under a root URL (./runs, file:///x, s3://bucket/prefix).

    <root>/<run>/config.yaml                          resolved config (write_config_once)
    <root>/<run>/metrics.jsonl                        one JSON line per iteration
    <root>/<run>/LATEST                               JSON {"iteration": i, ...}: the last commit
    <root>/<run>/iter-000003/{rollout,scored,experience}/part-*.arrow + _manifest.json
    <root>/<run>/checkpoints/iter-000003/{policy,critic,trainer}/ + _COMMITTED
    <root>/<run>/_prefect_results/                    Prefect's persisted task results
    <root>/cache/score/<scorer fingerprint>/          score cache segments, shared across runs

Paths are returned without protocol (what the filesystem `.fs` takes); `.url(path)` gives them back
as URLs (s3://...) for manifests, logs and other processes.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from typing import Any, Optional

import yaml

from ppoflow.config import StorageConfig
from storage import fs as fsutil

STAGES = ("rollout", "scored", "experience", "eval")
_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


# Keys that say where a run is, not what it is: a run folder copied to another root, bucket or endpoint
# resumes there (config.yaml is rewritten with the new values), and so does a run extended to more iterations.
LOCATION_KEYS = (
    "run.root",
    "run.iterations",
    "storage.endpoint_url",
    "storage.region",
    "storage.profile",
    "storage.local_cache_dir",
)


class ConfigConflictError(ValueError):
    """The run folder already holds a different config; the message names both hashes and the keys."""


def _config_hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two parsed configs."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        out: list[str] = []
        for k in keys:
            out += _differences(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def fingerprint_component(identity: str) -> str:
    """A scorer identity as one safe path component: kept when short and plain, else its sha256[:32]."""
    if _SAFE_COMPONENT.match(identity) and identity not in (".", ".."):
        return identity
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


def _in_run_dir(name: str) -> property:
    """A read-only attribute: the path of `name` directly in the run's folder."""
    return property(lambda self: fsutil.join(self.run_dir, name), doc=f"<root>/<run>/{name}")


class RunLayout:
    """The paths of run `run_name` under `root_url`. Cheap to build; the filesystem is resolved lazily.

    Pickles without its filesystem (it is re-resolved on first use), so it can cross process boundaries.
    """

    def __init__(self, root_url: str, run_name: str, storage_cfg: Optional[StorageConfig] = None):
        if not _SAFE_COMPONENT.match(run_name or ""):
            raise ValueError(f"run name {run_name!r} must match [A-Za-z0-9._-]{{1,64}} (it names a folder)")
        self.root_url = str(root_url)
        self.run_name = run_name
        self.storage_cfg = storage_cfg or StorageConfig()
        self._fs = None
        self._root = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "root_url": self.root_url,
            "run_name": self.run_name,
            "storage_cfg": self.storage_cfg,
            "_fs": None,
            "_root": None,
        }

    def __repr__(self) -> str:
        return f"RunLayout({self.root_url!r}, {self.run_name!r})"

    def _resolve(self) -> None:
        if self._fs is None:
            self._fs, self._root = fsutil.resolve(self.root_url, self.storage_cfg)

    @property
    def fs(self):
        self._resolve()
        return self._fs

    @property
    def root(self) -> str:
        self._resolve()
        return self._root

    def url(self, path: str) -> str:
        """`path` (as returned by this layout) as a URL: a plain path locally, s3://bucket/... on S3."""
        return fsutil.url_of(self.fs, path)

    # The run's folders and files.
    @property
    def run_dir(self) -> str:
        return fsutil.join(self.root, self.run_name)

    config_path = _in_run_dir("config.yaml")
    metrics_path = _in_run_dir("metrics.jsonl")
    latest_path = _in_run_dir("LATEST")
    results_dir = _in_run_dir("_prefect_results")
    checkpoints_dir = _in_run_dir("checkpoints")

    def iteration_dir(self, iteration: int) -> str:
        return fsutil.join(self.run_dir, iteration_name(iteration))

    def stage_dir(self, iteration: int, stage: str) -> str:
        if stage not in STAGES:
            raise ValueError(f"unknown stage folder {stage!r}; expected one of {', '.join(STAGES)}")
        return fsutil.join(self.iteration_dir(iteration), stage)

    def checkpoint_dir(self, iteration: int) -> str:
        return fsutil.join(self.checkpoints_dir, iteration_name(iteration))

    def score_cache_dir(self, fingerprint: str) -> str:
        """Shared by every run under the same root; see `fingerprint_component` for the folder name."""
        return fsutil.join(self.root, "cache", "score", fingerprint_component(fingerprint))

    def write_config_once(self, cfg_yaml: str, defaults: Optional[dict[str, Any]] = None) -> None:
        """Save the resolved config; on a resumed run, check that it is the same config.

        defaults: the config's default values (nested, JSON form). A key the saved config lacks and the new one
        holds at its default is a setting added by a newer ppoflow, not a change: it is no conflict.

        The first call writes config.yaml. Later calls accept the same config; when the only differences
        are among LOCATION_KEYS (the run folder moved to another root or bucket, a run extended to more
        iterations), or while the run has committed no iteration (no LATEST: a start that failed before its
        first commit, corrected), config.yaml is rewritten with the new values. Any other difference raises
        ConfigConflictError naming both hashes and the dotted keys that differ: resuming a run under
        another config would mix two experiments in one folder.
        """
        new = yaml.safe_load(cfg_yaml)
        old_text = None
        try:
            old_text = self.fs.cat_file(self.config_path).decode()
        except FileNotFoundError:
            pass
        if old_text is not None:
            old = yaml.safe_load(old_text)
            if old == new:
                return
            changed = [key for key in _differences(old, new) if not _added_at_default(key, old, new, defaults)]
            # Nothing committed yet (no LATEST): no iteration was trained under the saved config, so a start
            # that failed (a limit its preflight missed, a stage error) leaves the run name free for a fix.
            committed = self.fs.exists(self.latest_path)
            if committed and any(key not in LOCATION_KEYS for key in changed):
                raise ConfigConflictError(
                    f"{self.url(self.config_path)} holds another config (hash {_config_hash(old)}) than this "
                    f"run's (hash {_config_hash(new)}); differing keys: {', '.join(changed)}. Use a new "
                    f"run.name, or restore the saved config (only {', '.join(LOCATION_KEYS)} may change on "
                    f"resume)."
                )
        fsutil.write_bytes_atomic(self.fs, self.config_path, cfg_yaml.encode())


_MISSING = object()


def _at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _added_at_default(key: str, old: Any, new: Any, defaults: Optional[dict[str, Any]]) -> bool:
    """True when dotted `key` is absent from the saved config and the new config holds its default there."""
    return defaults is not None and _at(old, key) is _MISSING and _at(new, key) == _at(defaults, key)


def iteration_name(iteration: int) -> str:
    """iter-000003. Raises ValueError for a negative or non-integer iteration."""
    try:
        number = operator.index(iteration)  # accepts numpy ints, refuses floats and strings
    except TypeError:
        number = -1
    if isinstance(iteration, bool) or number < 0:
        raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
    return f"iter-{number:06d}"


def parse_iteration_name(name: str) -> Optional[int]:
    """3 for "iter-000003" (or a path ending in it); None for anything else."""
    match = re.fullmatch(r"iter-(\d{6,})", name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def layout_for(cfg) -> RunLayout:
    """The layout of the run a PPOFlowConfig describes (run.root, run.name, storage settings)."""
    return RunLayout(cfg.run.root, cfg.run.name, cfg.storage)
