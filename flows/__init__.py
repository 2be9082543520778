"""Prefect flows of ppoflow. Importing the package makes Prefect's API clients share one TLS context per process
(flows/prefect_client.py): each client otherwise spends ~20 ms of CPU loading the CA bundle."""

from flows.prefect_client import share_tls_context

share_tls_context()
