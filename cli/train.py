"""`ppoflow demo`, `ppoflow train`, `ppoflow deploy-run`, `ppoflow train-rm`: the commands that train (here, or as a
run of a deployment on its work pool)."""

from __future__ import annotations

from cli.capture import run_with_capture
from ppoflow.config import load_config


def cmd_demo(args) -> int:
    from flows.run import demo_config, prepare_demo, train

    overrides = list(args.set) + ([f"run.iterations={args.iterations}"] if args.iterations is not None else [])
    cfg = demo_config(overrides, root=args.root)

    def body(console) -> None:
        prepare_demo(cfg)
        train(cfg, console)

    return run_with_capture(cfg, "demo", args, body)


def add_demo(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="train the tiny model on the digits task, locally")
    demo.add_argument("--root", default="./runs", help="storage root (default ./runs)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    demo.add_argument("--iterations", type=int, default=None, help="run.iterations (default: configs/demo.yaml's)")
    demo.add_argument("--verbose", action="store_true", help="show the engines' and Prefect's output here too")
    demo.set_defaults(func=cmd_demo)


def cmd_train(args) -> int:
    from flows.run import train
    from flows.run_root import load_train_config

    cfg, note = load_train_config(args.config, args.set)  # run.root absolute; a run's own config.yaml finds the run

    def body(console) -> None:
        if note:
            console.print(note, highlight=False, markup=False, soft_wrap=True)
        train(cfg, console)

    return run_with_capture(cfg, "train", args, body)


def add_train(subparsers) -> None:
    train = subparsers.add_parser("train", help="train from a YAML config")
    train.add_argument("config")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    train.add_argument("--verbose", action="store_true", help="show the engines' and Prefect's output here too")
    train.set_defaults(func=cmd_train)


def cmd_deploy_run(args) -> int:
    from flows.deployment import schedule_deployment_run

    cfg = load_config(args.config, args.set)  # validated as `ppoflow train` validates it
    flow_run = schedule_deployment_run(cfg.model_dump(mode="json"), args.deployment)
    runner = f"a worker of work pool {flow_run.work_pool_name}" if flow_run.work_pool_name else "its runner"
    print(f"flow run {flow_run.name} ({flow_run.id}) of {args.deployment}: Scheduled; {runner} runs it")
    return 0


def add_deploy_run(subparsers) -> None:
    deploy_run = subparsers.add_parser(
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


def cmd_train_rm(args) -> int:
    from flows.rm_training import train_reward_model

    cfg = load_config(args.config, args.set)
    return run_with_capture(cfg, "train-rm", args, lambda console: train_reward_model(cfg, console))


def add_train_rm(subparsers) -> None:
    train_rm = subparsers.add_parser("train-rm", help="train a Bradley-Terry reward model (the rm_train section)")
    train_rm.add_argument("config")
    train_rm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    train_rm.add_argument("--verbose", action="store_true", help="show the engines' and Prefect's output here too")
    train_rm.set_defaults(func=cmd_train_rm)
