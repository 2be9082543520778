"""Prefect tasks of ppoflow. Every process that runs or submits them imports this package, so importing it adjusts
two things in Prefect for the process:
- its API clients share one TLS context (tasks/prefect_client.py): each client otherwise spends ~20 ms of CPU
  loading the CA bundle;
- when it has no PREFECT_API_URL, the temporary server Prefect starts for it replays requests that SQLite's
  locks refused instead of letting the client wait 2 s (ppoflow/prefect_server.py).
Commands that never touch Prefect (`ppoflow shards`, `runs ls`, `--help`) do not import it and do not pay
Prefect's import."""

from ppoflow.prefect_server import replay_on_temporary_server
from tasks.prefect_client import share_tls_context

share_tls_context()
replay_on_temporary_server()
