"""The Prefect flows, and what a run needs around them; below the `ppoflow` command (cli/), above the stage runtime
(runtime/).

    training.py, iteration.py, pipeline.py   the training flow, one iteration's subflow, iterations in flight
    stage_flows.py, worker_flow.py           the flows of the stage deployments and of the warm-worker deployments
    rm_training.py, fork_flow.py             reward-model training; a fork trained as a deployment's flow run
    deployment.py                            deploying and serving the training flow, `ppoflow deploy-run`'s run
    run.py, api.py                           a training run started from this process (`ppoflow train`, flows.api)
    preflight*.py, run_inputs.py, run_root.py, fork.py, rescore.py, records.py, artifacts.py, tracker.py,
    signal_advice.py                         a run's checks, inputs, lineage, metrics and what the UI shows of it
    failure.py, logs.py, run_names.py, subflow_identity.py   one message per failure, the run's log file, flow run
                                             names, an iteration subflow's identity across retries
"""
