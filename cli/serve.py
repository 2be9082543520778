"""The long-running commands: `ppoflow serve-reward` (a reward model or function over HTTP), `ppoflow worker` (a warm
stage worker, runtime/workers.py), `ppoflow serve` (the runs a Retry schedules, flows/deployment.py) and
`ppoflow prefect-server` (Prefect's server with the SQLite-lock replay, adaptations/prefect_server.py)."""

from __future__ import annotations

from ppoflow.config import ConfigError


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
    serve(
        source,
        host=args.host,
        port=args.port,
        token=token,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_request_items=args.max_request_items,
    )
    return 0


def add_serve_reward(subparsers) -> None:
    serve = subparsers.add_parser("serve-reward", help="serve a reward model or function over HTTP")
    serve.add_argument("--model", default=None)
    serve.add_argument("--function", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--token-env", default="PPOFLOW_REWARD_TOKEN")
    serve.add_argument("--max-batch-size", type=int, default=64)
    serve.add_argument("--max-wait-ms", type=float, default=10.0)
    serve.add_argument("--max-request-items", type=int, default=1024)
    serve.set_defaults(func=cmd_serve_reward)


def cmd_worker(args) -> int:
    from runtime.workers import serve_stages

    serve_stages(args.stage)
    return 0


def add_worker(subparsers) -> None:
    worker = subparsers.add_parser("worker", help="a warm stage worker: runs the stage tasks of pipeline.stage_workers")
    worker.add_argument("--stage", action="append", required=True, choices=["rollout", "score", "update", "checkpoint"])
    worker.set_defaults(func=cmd_worker)


def cmd_serve(args) -> int:
    from flows.deployment import serve_deployment

    serve_deployment()
    return 0


def add_serve(subparsers) -> None:
    serve_runs = subparsers.add_parser(
        "serve", help="execute the runs of the ppoflow-train deployment that a Retry (UI or CLI) schedules"
    )
    serve_runs.set_defaults(func=cmd_serve)


def cmd_prefect_server(args) -> int:
    from adaptations.prefect_server import serve_prefect_api

    serve_prefect_api(args.host, args.port)
    return 0


def add_prefect_server(subparsers) -> None:
    api = subparsers.add_parser(
        "prefect-server",
        help="Prefect's server (as `prefect server start`); a request refused by a SQLite lock conflict is "
        "replayed by the server within ~0.3 s instead of the client's 2 s back-off (adaptations/prefect_server.py)",
    )
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=4200)
    api.set_defaults(func=cmd_prefect_server)
