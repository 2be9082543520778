"""Shared fixtures live in tests/fixtures/, one file per real component (models, S3 server, Prefect server)."""
import os

# One thread per test process keeps the 2-core CI machine responsive when servers run beside the tests.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.s3",
    "tests.fixtures.prefect_server",
]
