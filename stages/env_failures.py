"""The rollout's failure policy for environments: a sample whose environment failed drops its whole GRPO group.

    drop_failed_groups(samples, records, spec, max_share) -> (kept samples, accounting)
    with_accounting(table, accounting) / env_failure_metrics(table)     carried in the rollout shards' metadata

Why whole groups: a group's baseline (GRPO's mean, RLOO's leave-one-out) is taken over its n samples; training the
survivors of a group with a failed sample would bias it (NeMo-RL and tinker-cookbook drop the group too). A group
is the n samples of one dataset row (engines/rollout/multi_turn.py runs them with on_env_failure "record").

The accounting (JSON in the shards' `ppoflow.env_failures` metadata, and rollout/env_* in the stage's metrics):
groups and samples of the iteration, failed groups, samples whose environment failed, the first error. More than
rollout.environment.max_failed_group_share of the groups failing fails the stage: EnvironmentFailuresExceeded, an
EnvironmentFailed naming the environment, the share, the dataset rows and the first error; so does an iteration
left with no group.
"""

from __future__ import annotations

import json

import pyarrow as pa

from engines.environments.checked import EnvironmentFailed

METADATA_KEY = b"ppoflow.env_failures"


class EnvironmentFailuresExceeded(EnvironmentFailed):
    """Too many groups' environments failed in one rollout; the message names environment, rows, first error."""


def drop_failed_groups(samples: list, records: list, spec: str, max_share: float) -> tuple[list, dict]:
    """`samples` (ConversationSample, prompt_index into `records`) without every group holding a sample whose
    env_error is set, and the accounting (module docstring). EnvironmentFailuresExceeded past `max_share`."""
    failed = [s for s in samples if s.env_error is not None]
    groups = {s.prompt_index for s in samples}
    dropped = sorted({s.prompt_index for s in failed})
    accounting = {
        "groups": len(groups),
        "failed_groups": len(dropped),
        "samples": len(samples),
        "failed_samples": len(failed),
        "first_error": failed[0].env_error if failed else None,
    }
    if dropped and (len(dropped) > max_share * len(groups) or len(dropped) == len(groups)):
        rows = [records[p].index for p in dropped]
        shown = ", ".join(map(str, rows[:20])) + (f" and {len(rows) - 20} more" if len(rows) > 20 else "")
        raise EnvironmentFailuresExceeded(
            f"rollout: environment {spec!r} failed in {len(dropped)} of {len(groups)} groups "
            f"({len(dropped) / len(groups):.0%}, over rollout.environment.max_failed_group_share={max_share}): "
            f"dataset rows {shown}; first error: {accounting['first_error']}"
        )
    keep = set(groups) - set(dropped)
    return [s for s in samples if s.prompt_index in keep], accounting


def with_accounting(table: pa.Table, accounting: dict) -> pa.Table:
    """`table` carrying `accounting` in its schema metadata (stages/tables.write_stage_table keeps it in the shards)."""
    metadata = dict(table.schema.metadata or {})
    metadata[METADATA_KEY] = json.dumps(accounting, sort_keys=True).encode()
    return table.replace_schema_metadata(metadata)


def env_failure_metrics(table: pa.Table) -> dict[str, float]:
    """rollout/env_failed_groups, rollout/env_failed_samples of a table with_accounting; {} for one without."""
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        return {}
    accounting = json.loads(raw)
    return {
        "rollout/env_failed_groups": float(accounting["failed_groups"]),
        "rollout/env_failed_samples": float(accounting["failed_samples"]),
    }
