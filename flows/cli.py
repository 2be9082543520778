"""The `ppoflow` command.

    ppoflow demo                          tiny model + digits task, trained on the embedded default
    ppoflow train CONFIG.yaml [--set section.field=value ...]
    ppoflow train-rm CONFIG.yaml [--set rm_train.epochs=3 ...]   reward model from preference pairs
    ppoflow shards ls|show|stats URI      inspect rollout / scored / experience shards (local or s3://)
    ppoflow runs ls [ROOT] | runs show RUN [--root ROOT]
    ppoflow serve-reward (--model DIR | --function SPEC) [--host 127.0.0.1] [--port 8000]
    ppoflow config-reference              the config fields as a Markdown table

With no PREFECT_API_URL the flows report to Prefect's ephemeral local server (SQLite, started for the
run); set PREFECT_API_URL to report to a running server and see the runs in its UI.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ppoflow.config import ConfigError, PPOFlowConfig, StorageConfig, load_config


def _storage_opts(args) -> StorageConfig:
    return StorageConfig(endpoint_url=args.endpoint_url) if getattr(args, "endpoint_url", None) else StorageConfig()


def cmd_train(args) -> int:
    from flows.run import train

    cfg = load_config(args.config, args.set)
    train(cfg)
    return 0


def cmd_train_rm(args) -> int:
    from flows.rm_training import train_reward_model

    train_reward_model(load_config(args.config, args.set))
    return 0


def cmd_demo(args) -> int:
    from flows.run import demo

    demo(args.set, root=args.root)
    return 0


def cmd_shards(args) -> int:
    from rich.console import Console

    from storage import inspect as shard_inspect

    storage_cfg = _storage_opts(args)
    if args.action == "ls":
        out = shard_inspect.shards_ls(args.uri, storage_cfg)
    elif args.action == "show":
        cols = args.columns.split(",") if args.columns else None
        out = shard_inspect.shards_show(args.uri, rows=args.rows, columns=cols, storage_cfg=storage_cfg)
    else:
        out = shard_inspect.shards_stats(args.uri, storage_cfg)
    Console().print(out)
    return 0


def cmd_runs(args) -> int:
    from rich.console import Console

    from flows.runs_view import runs_ls, runs_show

    storage_cfg = _storage_opts(args)
    out = runs_ls(args.root, storage_cfg) if args.action == "ls" else runs_show(args.root, args.run, storage_cfg)
    Console().print(out)
    return 0


def cmd_serve_reward(args) -> int:
    import os

    from engines.reward_server import serve

    if bool(args.model) == bool(args.function):
        raise ConfigError("serve-reward needs exactly one of --model DIR or --function SPEC")
    token = os.environ.get(args.token_env)
    if not token:
        raise ConfigError(f"serve-reward requires a bearer token in the environment variable {args.token_env}")
    if args.model:
        from engines.rewards.model import RewardModelSource
        source = RewardModelSource(args.model, name="model", batch_size=args.max_batch_size)
    else:
        from engines.rewards.function import FunctionRewardSource
        source = FunctionRewardSource(args.function, timeout_s=60.0, batch_size=args.max_batch_size, name="function")
    serve(source, host=args.host, port=args.port, token=token, max_batch_size=args.max_batch_size,
          max_wait_ms=args.max_wait_ms, max_request_items=args.max_request_items)
    return 0


def cmd_config_reference(args) -> int:
    from ppoflow.reference import config_reference_markdown

    print(config_reference_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ppoflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train the tiny model on the digits task, locally")
    demo.add_argument("--root", default="./runs", help="storage root (default ./runs)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", help="train from a YAML config")
    train.add_argument("config")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    train.set_defaults(func=cmd_train)

    train_rm = sub.add_parser("train-rm", help="train a Bradley-Terry reward model (the rm_train section)")
    train_rm.add_argument("config")
    train_rm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    train_rm.set_defaults(func=cmd_train_rm)

    shards = sub.add_parser("shards", help="inspect shards")
    shards.add_argument("action", choices=["ls", "show", "stats"])
    shards.add_argument("uri")
    shards.add_argument("--rows", type=int, default=10)
    shards.add_argument("--columns", default=None, help="comma-separated column names")
    shards.add_argument("--endpoint-url", default=None, help="S3 endpoint (MinIO, moto...)")
    shards.set_defaults(func=cmd_shards)

    runs = sub.add_parser("runs", help="list runs or show one")
    runs.add_argument("action", choices=["ls", "show"])
    runs.add_argument("run", nargs="?", default=None)
    runs.add_argument("--root", default="./runs")
    runs.add_argument("--endpoint-url", default=None)
    runs.set_defaults(func=cmd_runs)

    serve = sub.add_parser("serve-reward", help="serve a reward model or function over HTTP")
    serve.add_argument("--model", default=None)
    serve.add_argument("--function", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--token-env", default="PPOFLOW_REWARD_TOKEN")
    serve.add_argument("--max-batch-size", type=int, default=64)
    serve.add_argument("--max-wait-ms", type=float, default=10.0)
    serve.add_argument("--max-request-items", type=int, default=1024)
    serve.set_defaults(func=cmd_serve_reward)

    ref = sub.add_parser("config-reference", help="print the config reference (Markdown)")
    ref.set_defaults(func=cmd_config_reference)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    import os

    # Without PREFECT_API_URL, Prefect starts a local server for the run; its 20 s default start-up
    # timeout is too short on a busy 2-core machine (first start runs the database migrations).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    args = build_parser().parse_args(argv)
    if args.command == "runs" and args.action == "show" and not args.run:
        print("ppoflow runs show: name the run (ppoflow runs show RUN)", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"ppoflow: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
