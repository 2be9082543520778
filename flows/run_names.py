"""Flow run names that say which run they belong to (`ppo-training-<run.name>`), from the flow's `config` parameter.

Prefect names a flow run before the flow's body runs. The template `"ppo-training-{config[run][name]}"` raised
KeyError('run') for a parameter without run.name (`prefect deployment run ... --param config='{"pipeline": ...}'`
sets only the sections it changes), so the run crashed before any validation, its traceback only in the
worker's log. `named_after_run(prefix)` is a callable for `@flow(flow_run_name=...)` that never raises: a config
without a usable run.name gets the default run name, which is the one validation gives it, and the flow's own
validation (ppoflow.config.as_config) then names any real problem in the run's state.
"""

from __future__ import annotations

from typing import Any, Callable

from ppoflow.config import RunConfig

DEFAULT_RUN_NAME: str = RunConfig.model_fields["name"].default


def run_name_of(config: Any) -> str:
    """run.name of `config` (a PPOFlowConfig or its JSON form, valid or not); DEFAULT_RUN_NAME when it has none."""
    run = config.get("run") if isinstance(config, dict) else getattr(config, "run", None)
    name = run.get("name") if isinstance(run, dict) else getattr(run, "name", None)
    return name if isinstance(name, str) and name else DEFAULT_RUN_NAME


def named_after_run(prefix: str) -> Callable[[], str]:
    """A `flow_run_name` callable: `<prefix>-<run.name>` of the flow run's `config` parameter (Prefect calls it
    with no arguments inside the flow run's context)."""

    def flow_run_name() -> str:
        from prefect.runtime import flow_run

        return f"{prefix}-{run_name_of(flow_run.parameters.get('config'))}"

    return flow_run_name
