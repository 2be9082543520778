"""Where and how a stage of an iteration runs: the floor between the Prefect tasks (tasks/) and the Prefect flows
(flows/).

    placement.py     where a stage runs (in-process, warm worker, update group, pool, replay, parts): decided once
    executors.py     one Executor per stage, chosen once per run (InProcess, WarmWorkers, UpdateGroup,
                     PoolDeployments); run_stage for a stage run on its own
    stage_runs.py    what each executor does: the task here, on a warm worker, on the group
    pool_deployments.py  PoolDeployments: a stage as a flow run of its deployment on a work pool, and its pickup
    workers.py       `ppoflow worker`: a warm process that serves stage tasks and keeps its engines
    update_group.py  the torchrun group of update ranks a training run starts for itself
    in_flight.py     the iterations in flight in this process, and how a later one learns an earlier one failed
    replay.py        a fork's replayed rollout, answered from its parent's records
    stale_runs.py    one process trains a run at a time; Prefect learns that a run's process died
    prefect_api.py   is the Prefect API that PREFECT_API_URL names there, and the temporary server's start-up

Imports tasks, stages, engines and storage, never flows/ or cli/ (tests/unit/test_import_graph.py).
"""
