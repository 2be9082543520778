"""The fork as a Prefect flow, for the deployment `ppo-fork/ppoflow-fork` (flows/deployment.py) that `ppoflow serve`
runs: the UI's "Run" on it opens a form with these parameters, which is how a fork starts from the Prefect UI.

    ppo_fork(run="demo", at=20, name="demo-kl0.05", root="./runs", set=["algo.kl_coef=0.05"], replay=0)

The flow makes the fork (flows/fork.py: refused before any work, the flow run Failed with the message naming the
field) and trains it as a subflow run of the training flow, `ppo-training-<name>`, with the fork's config as its
parameter: a Retry of that subflow, or `ppoflow train <root>/<name>/config.yaml`, resumes it as any run. Forking
again with the same parameters is a no-op, so a Retry of this flow run resumes the fork too.
"""

from __future__ import annotations

from typing import Any, Optional

from prefect import flow


@flow(name="ppo-fork", flow_run_name="ppo-fork-{name}")
def ppo_fork(
    run: str,
    at: int,
    name: str,
    root: str = "./runs",
    set: Optional[list[str]] = None,  # noqa: A002 - the CLI's --set, as the UI form names it
    replay: int = 0,
    endpoint_url: Optional[str] = None,
) -> dict[str, Any]:
    """Fork run `run` (under `root`) at its committed iteration `at` as run `name`, with the `set` overrides
    (section.field=value) and `replay` iterations replayed from `run`'s saved rollouts; train it. Returns the
    training flow's result (run_uri, first_iteration, last_iteration, iterations)."""
    from flows.fork import fork_run
    from flows.training import ppo_training
    from ppoflow.config import StorageConfig

    storage_cfg = StorageConfig(endpoint_url=endpoint_url) if endpoint_url else None
    cfg = fork_run(root, run, at, name, list(set or []), storage_cfg, replay)
    return ppo_training(config=cfg.model_dump(mode="json"))
