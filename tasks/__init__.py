"""Prefect tasks of ppoflow. Every process that runs or submits them imports this package, so importing it makes
Prefect's API clients share one TLS context per process (tasks/prefect_client.py): each client otherwise spends
~20 ms of CPU loading the CA bundle. Commands that never touch Prefect (`ppoflow shards`, `runs ls`, `--help`)
do not import it and do not pay Prefect's import."""

from tasks.prefect_client import share_tls_context

share_tls_context()
