"""run: and storage: -- which run, where it lives."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator

from ppoflow.config.base import RESERVED_RUN_NAMES, _Section


class RunConfig(_Section):
    name: str = Field("demo", description="Run name; the run's folder is <root>/<name>.", pattern=r"^[A-Za-z0-9._-]+$")
    root: str = Field(
        "./runs", description="Storage root as a path or fsspec URL (./runs, file:///x, s3://bucket/prefix)."
    )
    iterations: int = Field(10, ge=1, description="Total PPO iterations; a resumed run continues from LATEST + 1.")
    seed: int = Field(0, description="Seed for sampling, initialisation and data order.")
    keep_checkpoints: int = Field(2, ge=1, description="Committed checkpoints kept; the latest is never removed.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if name in RESERVED_RUN_NAMES or len(name) > 64:
            raise ValueError(
                f"must be a plain folder name of 1-64 characters [A-Za-z0-9._-], not one of "
                f"{', '.join(repr(n) for n in RESERVED_RUN_NAMES)} (they name the root, its parent "
                f"or the shared score cache)"
            )
        return name


class StorageConfig(_Section):
    endpoint_url: Optional[str] = Field(None, description="S3 endpoint URL (MinIO, moto, Ceph); None = AWS.")
    region: Optional[str] = Field(None, description="S3 region.")
    profile: Optional[str] = Field(
        None, description="AWS profile; credentials otherwise from the usual AWS_* variables."
    )
    shard_max_rows: int = Field(4096, ge=1, description="Rows per Arrow part before a new part starts.")
    shard_max_bytes: int = Field(
        256 * 2**20, ge=1024, description="Bytes per Arrow part (approximate) before a new part starts."
    )
    multipart_chunk_bytes: int = Field(
        50 * 2**20,
        ge=5 * 2**20,
        description="S3 multipart chunk size; objects of 2x this or more go up as a multipart upload (aborted on failure).",
    )
    local_cache_dir: Optional[str] = Field(
        None,
        description="Local folder for copies of remote checkpoints (vLLM/transformers need local folders), under checkpoints/<run name>/; None = $PPOFLOW_CACHE, else ~/.cache/ppoflow.",
    )
    checkpoint_cache_keep: int = Field(
        2,
        ge=1,
        description="Copies of remote checkpoints kept per run in the local cache, most recently used first; older ones are deleted after each load (each copy is a whole checkpoint, or the parts a worker fetched).",
    )

    def fsspec_options(self) -> dict[str, Any]:
        """Keyword arguments for `fsspec.filesystem("s3", ...)`; empty for AWS defaults."""
        opts: dict[str, Any] = {}
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        if client:
            opts["client_kwargs"] = client
        if self.profile:
            opts["profile"] = self.profile
        return opts
