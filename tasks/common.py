"""What every stage task shares: the run layout, the cache key, where results persist.

Cache key = run / iteration / stage / hash(input manifests' content hashes, the stage's config sections).
A retried flow run recomputes the same keys, finds the persisted results of the stages that completed,
and resumes at the first stage without one. A changed input or setting changes the key, so a stale
result is never reused.

Results are the stage manifests (small JSON), persisted with Prefect's JSON serializer under
<root>/<run>/_prefect_results so that any worker that can read the run's storage finds them.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from collections import Counter
from typing import Any

from ppoflow.config import PPOFlowConfig
from storage.layout import RunLayout

# How many times each stage's body ran in this process (a cached stage does not run its body, so its
# engines are not called). Read by tests and by the overhead benchmark.
STAGE_BODY_CALLS: Counter = Counter()

# The config sections each stage's output depends on (besides its input manifests).
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "rollout": ("model", "data", "rollout"),
    "score": ("model", "reward", "score", "rollout"),
    "update": ("model", "algo", "train", "reward"),
    "checkpoint": ("run",),
}


def as_config(config: PPOFlowConfig | dict) -> PPOFlowConfig:
    """Flows receive the config as a model or as its JSON form (deployments, run_deployment)."""
    return config if isinstance(config, PPOFlowConfig) else PPOFlowConfig.model_validate(config)


def layout_for(cfg: PPOFlowConfig) -> RunLayout:
    return RunLayout(cfg.run.root, cfg.run.name, cfg.storage)


def local_path_state(path: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of a local file, or of the files in a local folder; [] when neither.

    Part of the identity of a process-wide engine built from local files (a reference model, a tokenised
    dataset): rewriting the files in place under the same path then rebuilds the engine.
    """
    root = Path(path).expanduser()
    if root.is_file():
        st = root.stat()
        return [(root.name, st.st_size, st.st_mtime_ns)]
    if not root.is_dir():
        return []
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file())


def stable_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def stage_cache_key(cfg: PPOFlowConfig, stage: str, iteration: int, inputs: dict[str, Any]) -> str:
    """The key under which a stage's result is persisted; see the module docstring."""
    digest = stable_hash({"inputs": inputs, "config": cfg.section_hash(*STAGE_SECTIONS[stage]),
                          "seed": cfg.run.seed, "root": cfg.run.root})
    return f"{cfg.run.name}-iter-{iteration:06d}-{stage}-{digest}"


def cache_key_fn(stage: str):
    """A Prefect cache_key_fn for a stage task whose parameters are (config, iteration, **input manifests)."""
    def _key(_context, parameters: dict[str, Any]) -> str:
        cfg = as_config(parameters["config"])
        inputs = {k: _manifest_identity(v) for k, v in parameters.items() if k not in ("config", "iteration")}
        return stage_cache_key(cfg, stage, int(parameters["iteration"]), inputs)
    return _key


def _manifest_identity(value: Any) -> Any:
    # A manifest is identified by its content hash; other parameters by their JSON form.
    if isinstance(value, dict) and "content_hash" in value:
        return value["content_hash"]
    return value


_saved_storage: dict[str, Any] = {}


def result_storage_for(cfg: PPOFlowConfig):
    """A Prefect filesystem block rooted at the run's results folder (local path or remote URL).

    Prefect requires result storage to be saved server-side (so any worker can read the results): the
    block is saved once per process under a name derived from its location, overwriting an equal one.
    """
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    layout = layout_for(cfg)
    url = layout.url(layout.results_dir)
    options = cfg.storage.fsspec_options()
    name = "ppoflow-results-" + stable_hash({"url": url, "options": options})[:16]
    if name not in _saved_storage:
        if "://" in url and not url.startswith("file://"):
            block = RemoteFileSystem(basepath=url, settings=options)
        else:
            block = LocalFileSystem(basepath=url.removeprefix("file://"))
        block.save(name, overwrite=True)
        _saved_storage[name] = block
    return _saved_storage[name]
