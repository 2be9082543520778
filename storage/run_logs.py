"""Where a run's local files that are not shards go: its log folder, and the local mirror of a run on object storage.

    log_dir_for(cfg)  -> ("/abs/runs/demo/logs", None)                                  a local root
                      -> ("<cache>/mirror/bucket_runs-1a2b3c4d/demo/logs", "s3://bucket/runs/demo/logs")
    mirror_dir(root_url, run_name)  the local folder a run on object storage writes through (logs, TensorBoard)

Pure paths (nothing is created): the command's output capture (flows/logs.py), the update group's log
(runtime/update_group.py) and the TensorBoard tracker (flows/tracker.py) all take their folders from here.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from ppoflow.config import PPOFlowConfig
from storage.fs import local_cache_root


def mirror_dir(root_url: str, run_name: str, local_cache_dir: Optional[str] = None) -> str:
    """The local mirror of a run on object storage: `<local cache>/mirror/<root as a folder name>/<run>`.

    Named after the root URL (readable part plus a hash), so two buckets with the same run name do not
    share a folder.
    """
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in root_url.split("://", 1)[-1])[:80]
    digest = hashlib.sha256(root_url.encode()).hexdigest()[:8]
    return os.path.join(local_cache_root(local_cache_dir), "mirror", f"{readable}-{digest}", run_name)


def _is_local_root(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


def log_dir_for(cfg: PPOFlowConfig) -> tuple[str, Optional[str]]:
    """(local folder the log file is written to, remote folder URL it is copied to, or None when local)."""
    root = str(cfg.run.root)
    if _is_local_root(root):
        local_root = root[len("file://") :] if root.startswith("file://") else root
        return os.path.join(os.path.abspath(local_root), cfg.run.name, "logs"), None
    mirror = mirror_dir(root, cfg.run.name, cfg.storage.local_cache_dir)
    return os.path.join(mirror, "logs"), root.rstrip("/") + f"/{cfg.run.name}/logs"
