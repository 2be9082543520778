"""A warm stage worker as a flow run, so that a work pool can start it: the deployments `ppo-stage-worker/*` of
prefect.yaml.

    prefect work-pool create worker-pool --type process        (or kubernetes: docs "Deploying")
    prefect deploy --name ppo-rollout-worker --name ppo-score-worker --name ppo-train-worker
    prefect worker start --pool worker-pool
    prefect deployment run ppo-stage-worker/ppo-rollout-worker  (one per worker wanted; each runs until stopped)

The flow run is the worker (`runtime.workers.serve_stages`, what `ppoflow worker --stage ...` runs): it serves the
stage tasks of its `stages` for as long as it runs, its engines warm between iterations and runs, and a training run
with those stages in `pipeline.stage_workers` sends them there. What Prefect shows of it: the flow run stays Running
while it serves; when its process dies (killed, out of memory, the pod evicted) the pool's worker reports the exit
and the server marks it Crashed; cancelling it from the UI stops it. A training run's stage that a dead worker held
fails by name (its lease: tasks/leases.py), and one that no worker takes fails after
`pipeline.deadlines.pickup_s` naming the stage (runtime/stage_runs.py); start the deployment again and retry.
"""

from __future__ import annotations

from prefect import flow

from runtime.workers import STAGES, serve_stages


@flow(name="ppo-stage-worker", log_prints=True)
def stage_worker(stages: list[str]) -> None:
    """Serve the stage tasks of `stages` (rollout, score, update, checkpoint; rollout brings its parts and eval) until
    the flow run is stopped; a failed stage is retried here by its run's pipeline.retries (tasks/retries.py).
    Raises ValueError naming an unknown stage before serving anything."""
    unknown = sorted(set(stages) - set(STAGES))
    if unknown or not stages:
        raise ValueError(f"stage_worker(stages={stages!r}): each must be one of {', '.join(STAGES)}")
    print(f"serving the {', '.join(stages)} stage tasks until this flow run is stopped")
    serve_stages(stages)
