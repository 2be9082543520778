"""The Python entry point: train a run from a script or a notebook, exactly as `ppoflow train` does.

    from flows.api import train
    result = train("my-run.yaml")                                      # = ppoflow train my-run.yaml
    result = train("my-run.yaml", overrides=["run.iterations=5"])      # = ... --set run.iterations=5

Same config loading and validation (`ppoflow.config.load_config`), same training flow and deployment
(`flows.run.train`), same output handling (the engines' and Prefect's output goes to the run's log file,
`<root>/<run>/logs/train-<UTC time>-<pid>.log`; `verbose=True` shows it here too), same resume at LATEST + 1.
Where the CLI prints one message and exits with a status, this raises: `ConfigError` for a bad config (naming
the field), and the run's own exception otherwise, after writing its traceback to the log file. The process's
output is given back when the call returns or raises, so a notebook can call it again.

Why here and not `ppoflow.train`: the `ppoflow` package is the config floor and imports none of the flows
(tests/unit/test_import_graph.py); the entry point of a run belongs to the floor that runs flows.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterable, TextIO, Union

from ppoflow.config import PPOFlowConfig, apply_overrides, build_config, load_config

ConfigLike = Union[str, Path, dict, PPOFlowConfig]


def load(config: ConfigLike, overrides: Iterable[str] = ()) -> PPOFlowConfig:
    """A validated config from a YAML path, a dict (the YAML's mapping) or a config, with `--set`-style overrides.

    ConfigError names the file, field and value, as `ppoflow train` does."""
    overrides = list(overrides)
    if isinstance(config, (str, Path)):
        return load_config(config, overrides)
    data = config.model_dump(mode="json") if isinstance(config, PPOFlowConfig) else dict(config)
    if overrides:
        apply_overrides(data, overrides)
    return build_config(data, "train() config" + (" + overrides" if overrides else ""))


def train(config: ConfigLike, overrides: Iterable[str] = (), *, verbose: bool = False) -> dict[str, Any]:
    """Train the run `config` describes, as `ppoflow train CONFIG --set OVERRIDE ...` does; blocks until it ends.

    Returns the training flow's result: {"run_uri": where the run is, "first_iteration", "last_iteration",
    "iterations": one metrics row (dict) per iteration trained by this call}. A run already complete trains
    nothing and returns an empty "iterations". Raises ConfigError before any work for a bad config or a
    PREFECT_API_URL that does not answer, and the stage's error (StageError, RewardError, ...) when a run fails."""
    from flows.failure import log_traceback
    from flows.logs import capture_output
    from flows.run import train as run_training

    _prepare_process()
    cfg = load(config, overrides)
    capture = capture_output(cfg, "train", verbose=verbose)
    try:
        from rich.console import Console

        return run_training(cfg, Console(file=_terminal(capture.terminal), highlight=False))
    except BaseException as e:
        log_traceback(e)
        raise
    finally:
        capture.release()
        capture.publish(cfg.storage)


def _prepare_process() -> None:
    """What `ppoflow`'s main does before a command that runs flows (cli/main.py): quiet the libraries at their
    source, give Prefect's temporary server time to start on a busy machine, install the upstream adaptations."""
    from adaptations import install_process_adaptations
    from flows.logs import prepare_flow_process

    prepare_flow_process()
    install_process_adaptations()


def _terminal(captured: TextIO) -> TextIO:
    """Where the progress bar and table go: the capture's copy of fd 1 when sys.stdout writes to fd 1 (a script,
    a terminal), else sys.stdout itself (a notebook's stdout is not fd 1: Jupyter shows what is written to it)."""
    try:
        return captured if sys.stdout.fileno() == 1 else sys.stdout
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: no file descriptor (a notebook)
        return sys.stdout
