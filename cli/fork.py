"""`ppoflow fork` and `ppoflow rescore`: a new run from a run's committed iteration (flows/fork.py), and the fork at
K-1 whose iteration K is the run's saved rollouts scored again (flows/rescore.py)."""

from __future__ import annotations

from cli.capture import run_with_capture
from cli.on_storage import storage_opts


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
    return run_with_capture(cfg, "fork", args, lambda console: train(cfg, console))


def add_fork(subparsers) -> None:
    fork = subparsers.add_parser("fork", help="a new run from a run's committed iteration N, sharing 1..N by reference")
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


def cmd_rescore(args) -> int:
    """`ppoflow rescore`: the fork at K-1 replaying K (flows/rescore.py), its score stage only; prints both rewards."""
    from flows.rescore import rescore_fork, rescore_report

    cfg = rescore_fork(args.root, args.run, args.iteration, args.name, args.set, storage_opts(args))
    # crop=False: the shards' URI and the command that trains on are printed whole (flows/rescore.rescore_summary)
    report = lambda console: console.print(rescore_report(cfg, args.iteration), highlight=False, crop=False)  # noqa: E731
    return run_with_capture(cfg, "rescore", args, report)


def add_rescore(subparsers) -> None:
    rescore = subparsers.add_parser(
        "rescore", help="a fork at K-1 whose iteration K is RUN's saved rollouts scored again"
    )
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
