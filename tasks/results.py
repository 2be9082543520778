"""Where stage tasks persist their results: a Prefect filesystem block at <root>/<run>/_prefect_results.

The results are the stage manifests (small JSON), so any worker that can read the run's storage finds them.
"""

from __future__ import annotations

from typing import Any

from ppoflow.config import PPOFlowConfig
from ppoflow.fingerprint import json_hash
from storage.layout import layout_for

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
    name = "ppoflow-results-" + json_hash({"url": url, "options": options})[:16]
    if name not in _saved_storage:
        if "://" in url and not url.startswith("file://"):
            block = RemoteFileSystem(basepath=url, settings=options)
        else:
            block = LocalFileSystem(basepath=url.removeprefix("file://"))
        block.save(name, overwrite=True)
        _saved_storage[name] = block
    return _saved_storage[name]
