"""The storage a command reads (a local folder or S3) and how its errors reach the user.

storage_opts(args) -> StorageConfig       --endpoint-url when given, else the defaults
on_storage(url, storage_cfg, body) -> exit code: on S3 the bucket is checked first, and any storage error is one
                                      `ppoflow: error:` line naming the URL and the endpoint, not a traceback
"""

from __future__ import annotations

import sys
from typing import Callable

from ppoflow.config import StorageConfig


def storage_opts(args) -> StorageConfig:
    return StorageConfig(endpoint_url=args.endpoint_url) if getattr(args, "endpoint_url", None) else StorageConfig()


def on_storage(url: str, storage_cfg: StorageConfig, body: Callable[[], int]) -> int:
    """Run `body` of `ppoflow shards|runs` on the storage at `url`. On S3 the bucket is checked first (one HEAD),
    and a storage error (a missing bucket, an endpoint that does not answer, credentials, a missing or corrupt
    file) is one `ppoflow: error:` line naming the URL and the endpoint, exit 1, not a traceback. A local
    path's errors go to main's handler, which names the path."""
    from storage import fs as fsutil

    if fsutil.is_local(fsutil.resolve(url, storage_cfg)[0]):
        return body()
    from botocore.exceptions import BotoCoreError, ClientError

    from flows.preflight_static import bucket_problem

    problem = bucket_problem(url, storage_cfg)  # names the bucket and the endpoint
    if problem is None:
        try:
            return body()
        except (OSError, ValueError, KeyError, BotoCoreError, ClientError) as e:
            problem = f"{type(e).__name__} at {storage_cfg.endpoint_url or 'AWS'}: {e}"
    hint = "" if storage_cfg.endpoint_url else " (MinIO, moto, Ceph: pass --endpoint-url URL)"
    print(f"ppoflow: error: {url}: {problem}{hint}", file=sys.stderr)
    return 1
