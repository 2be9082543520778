"""Prefect artifacts of a run: a metrics table per iteration, the shard URIs, and a progress bar."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from ppoflow.config import PPOFlowConfig


def _key(cfg: PPOFlowConfig, what: str) -> str:
    # Artifact keys allow lowercase letters, digits and dashes only.
    safe = "".join(c if c.isalnum() else "-" for c in cfg.run.name.lower())
    return f"{safe}-{what}"


def publish_iteration_artifacts(
    cfg: PPOFlowConfig, iteration: int, row: dict[str, Any], manifests: dict[str, dict]
) -> None:
    table = [
        {"metric": k, "value": v if isinstance(v, (int, float, str)) or v is None else str(v)} for k, v in row.items()
    ]
    create_table_artifact(
        table=table, key=_key(cfg, "metrics"), description=f"{cfg.run.name}: metrics of iteration {iteration}"
    )
    lines = [
        f"# {cfg.run.name}, iteration {iteration}",
        "",
        f"- rollout shards: `{manifests['rollout']['uri']}` ({manifests['rollout']['rows']} rows)",
        f"- scored shards: `{manifests['score']['uri']}`",
        f"- experience shards: `{manifests['update']['experience_uri']}`",
        f"- checkpoint: `{manifests['checkpoint']['uri']}`",
        *[f"- eval shards: `{m['uri']}` ({m['rows']} rows)" for m in [manifests.get("eval")] if m],
        "",
        "Open them with `ppoflow shards show URI`, pyarrow, datasets or duckdb.",
    ]
    create_markdown_artifact(
        markdown="\n".join(lines),
        key=_key(cfg, "shards"),
        description=f"{cfg.run.name}: outputs of iteration {iteration}",
    )


def start_progress(cfg: PPOFlowConfig, done: int) -> UUID:
    return create_progress_artifact(
        progress=100.0 * done / cfg.run.iterations,
        key=_key(cfg, "progress"),
        description=f"{cfg.run.name}: iterations committed of {cfg.run.iterations}",
    )


def update_progress(artifact_id: UUID, cfg: PPOFlowConfig, done: int) -> None:
    update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / cfg.run.iterations)
