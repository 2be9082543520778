"""`ppoflow shards ls|show|stats URI`: inspect rollout / scored / experience shards (local or s3://)."""

from __future__ import annotations

import sys

from cli.on_storage import on_storage, storage_opts


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

    return on_storage(args.uri, storage_cfg, body)


def add_shards(subparsers) -> None:
    shards = subparsers.add_parser("shards", help="inspect shards")
    shards.add_argument("action", choices=["ls", "show", "stats"])
    shards.add_argument("uri")
    shards.add_argument("--rows", type=int, default=10)
    shards.add_argument("--columns", default=None, help="comma-separated column names")
    shards.add_argument("--endpoint-url", default=None, help="S3 endpoint (MinIO, moto...)")
    shards.set_defaults(func=cmd_shards)
