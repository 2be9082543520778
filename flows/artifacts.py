"""Prefect artifacts of a run: per iteration its metrics and the URIs of its shards, and a progress bar."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from ppoflow.config import PPOFlowConfig


def _key(cfg: PPOFlowConfig, what: str) -> str:
    # Artifact keys allow lowercase letters, digits and dashes only.
    safe = "".join(c if c.isalnum() else "-" for c in cfg.run.name.lower())
    return f"{safe}-{what}"


def publish_iteration_artifacts(cfg: PPOFlowConfig, row: dict[str, Any]) -> None:
    """One markdown artifact per iteration (key `<run>-iteration`, a new version each iteration), created by the
    training flow so that its run's Artifacts tab lists every iteration: the metrics row as a table, then where
    its shards and checkpoint are (read back from the iteration's stage records). One artifact, not a table and
    a list: each is a request on the iteration's path (~10 ms here)."""
    from storage.layout import layout_for
    from storage.stage_records import read_stage_record

    iteration = row["iteration"]
    layout = layout_for(cfg)
    stages = ("rollout", "score", "update", "checkpoint", "eval")
    manifests = {s: m for s in stages if (m := read_stage_record(layout, iteration, s)) is not None}
    create_markdown_artifact(
        markdown=iteration_markdown(cfg, iteration, row, manifests),
        key=_key(cfg, "iteration"),
        description=f"{cfg.run.name}: metrics and outputs of iteration {iteration}",
    )


def iteration_markdown(cfg: PPOFlowConfig, iteration: int, row: dict[str, Any], manifests: dict[str, dict]) -> str:
    """The artifact's text: a `metric | value` table of `row` (floats to 6 significant digits), then the URIs."""
    lines = [f"# {cfg.run.name}, iteration {iteration}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(v, k)} |" for k, v in row.items()]
    lines += [
        "",
        f"- rollout shards: `{manifests['rollout']['uri']}` ({manifests['rollout']['rows']} rows)",
        f"- scored shards: `{manifests['score']['uri']}`",
        f"- experience shards: `{manifests['update']['experience_uri']}`",
        f"- checkpoint: `{manifests['checkpoint']['uri']}`",
        *[f"- eval shards: `{m['uri']}` ({m['rows']} rows)" for m in [manifests.get("eval")] if m],
        "",
        "Open them with `ppoflow shards show URI`, pyarrow, datasets or duckdb.",
    ]
    return "\n".join(lines)


def _cell(value: Any, key: str = "") -> str:
    """A float to 6 significant digits, except a time (`*_unix`, seconds since 1970) as UTC to the second: 6
    digits of 1795890601.2 are 1.79589e+09, which says nothing."""
    if key.endswith("_unix") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.fromtimestamp(value, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")  # a `|` in a value would end the cell


def start_progress(cfg: PPOFlowConfig, done: int) -> UUID:
    return create_progress_artifact(
        progress=100.0 * done / cfg.run.iterations,
        key=_key(cfg, "progress"),
        description=f"{cfg.run.name}: iterations committed of {cfg.run.iterations}",
    )


def update_progress(artifact_id: UUID, cfg: PPOFlowConfig, done: int) -> None:
    update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / cfg.run.iterations)
