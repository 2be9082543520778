"""The `ppoflow` command: the top floor, above the Prefect flows (flows/) and the stage runtime (runtime/).

    main.py              `ppoflow` (the console script; `python -m cli`): the parser, made of each command's own
    train.py             demo, train, deploy-run, train-rm
    fork.py              fork, rescore
    models.py            models fetch|ls
    shards.py            shards ls|show|stats
    runs.py              runs ls|show|plot|repair|accept-inputs (runs_view.py, plot.py, repair.py: their bodies)
    serve.py             serve-reward, worker, serve, prefect-server
    config_reference.py  config-reference
    capture.py           a training command's output capture and its one failure message
    on_storage.py        the storage a command reads, and its errors as one line

Each command module has `add_<command>(subparsers)` beside the command's body. Nothing below imports cli/
(tests/unit/test_import_graph.py).
"""
