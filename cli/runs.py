"""`ppoflow runs ls|show|plot|repair|accept-inputs`: the runs under a root, one run's table, its plot, a corrupt latest
checkpoint quarantined, its changed inputs accepted."""

from __future__ import annotations

from cli.on_storage import on_storage, storage_opts


def cmd_runs(args) -> int:
    import sys

    from rich.console import Console

    if args.action != "ls" and not args.run:
        print(f"ppoflow runs {args.action}: name the run (ppoflow runs {args.action} RUN)", file=sys.stderr)
        return 2

    from cli.runs_view import runs_ls, runs_show

    storage_cfg = storage_opts(args)
    # `runs ls ROOT`: the positional names the root here (it names the run for show and plot).
    root = (args.run or args.root) if args.action == "ls" else args.root

    def body() -> int:
        if args.action == "ls":
            out = runs_ls(root, storage_cfg)
        elif args.action == "plot":
            from cli.plot import plot_run

            out = f"wrote {plot_run(root, args.run, args.out, storage_cfg)}"
        elif args.action == "repair":
            from cli.repair import repair_run

            out = repair_run(root, args.run, storage_cfg)
        elif args.action == "accept-inputs":
            from flows.run_inputs import accept_run_inputs

            out = accept_run_inputs(root, args.run, storage_cfg)
        else:
            out = runs_show(root, args.run, storage_cfg)
        Console().print(out, crop=False)  # a cell wider than the width is printed whole (ppoflow/tables.py)
        return 0

    return on_storage(root, storage_cfg, body)


def add_runs(subparsers) -> None:
    runs = subparsers.add_parser(
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
