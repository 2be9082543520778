"""`ppoflow shards ...` and `ppoflow runs ...`: the commands that read a run's storage (a local folder or S3).

Each runs its body through `_on_storage`: on S3 the bucket is checked first, and any storage error is one
`ppoflow: error:` line naming the URL and the endpoint instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Callable

from ppoflow.config import StorageConfig


def storage_opts(args) -> StorageConfig:
    return StorageConfig(endpoint_url=args.endpoint_url) if getattr(args, "endpoint_url", None) else StorageConfig()


def cmd_shards(args) -> int:
    from rich.console import Console

    from storage import inspect as shard_inspect

    storage_cfg = storage_opts(args)
    broken: list[str] = []

    def body() -> int:
        if args.action == "ls":
            out = shard_inspect.shards_ls(args.uri, storage_cfg, broken=broken)
        elif args.action == "show":
            cols = args.columns.split(",") if args.columns else None
            out = shard_inspect.shards_show(args.uri, rows=args.rows, columns=cols, storage_cfg=storage_cfg)
        else:
            out = shard_inspect.shards_stats(args.uri, storage_cfg)
        Console().print(out, crop=False)  # a cell wider than the width is printed whole (ppoflow/tables.py)
        if broken:
            print(
                f"ppoflow: error: {len(broken)} stage folder(s) with missing or truncated parts: " + ", ".join(broken),
                file=sys.stderr,
            )
            return 1
        return 0

    return _on_storage(args.uri, storage_cfg, body)


def cmd_runs(args) -> int:
    from rich.console import Console

    from flows.runs_view import runs_ls, runs_show

    storage_cfg = storage_opts(args)
    # `runs ls ROOT`: the positional names the root here (it names the run for show and plot).
    root = (args.run or args.root) if args.action == "ls" else args.root

    def body() -> int:
        if args.action == "ls":
            out = runs_ls(root, storage_cfg)
        elif args.action == "plot":
            from flows.plot import plot_run

            out = f"wrote {plot_run(root, args.run, args.out, storage_cfg)}"
        elif args.action == "repair":
            from flows.repair import repair_run

            out = repair_run(root, args.run, storage_cfg)
        elif args.action == "accept-inputs":
            from flows.run_inputs import accept_run_inputs

            out = accept_run_inputs(root, args.run, storage_cfg)
        else:
            out = runs_show(root, args.run, storage_cfg)
        Console().print(out, crop=False)  # a cell wider than the width is printed whole (ppoflow/tables.py)
        return 0

    return _on_storage(root, storage_cfg, body)


def _on_storage(url: str, storage_cfg: StorageConfig, body: Callable[[], int]) -> int:
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
