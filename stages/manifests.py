"""What the stages hand each other: small, typed, JSON-able references to what they wrote to storage.

    PolicyRef           the weights an iteration samples and trains from (initial folder or a checkpoint)
    RolloutManifest     rollout shards of an iteration        (rollout -> score)
    RolloutPartManifest one part of a split rollout           (rollout part -> the merge into a RolloutManifest)
    ScoreManifest       scored shards                         (score -> update)
    UpdateManifest      experience shards + staged checkpoint (update -> checkpoint)
    CheckpointManifest  the committed checkpoint              (checkpoint -> the next iteration)
    EvalManifest        eval shards + eval/* metrics          (eval -> the iteration's metrics row)

Every hand-off has an `identity()`: the content hash of what it names (never a time, a path alone or a
stat of a folder), which is all a stage's Prefect cache key takes from its inputs. They are frozen pydantic
models: Prefect's JSON result serializer stores and restores them as these classes, `run_deployment`
passes them as JSON (`model_dump(mode="json")`) and a stage flow's signature validates them back, and a
stage record read from storage is validated where it is read (a malformed record is a ValidationError
naming the field, not a KeyError three stages later).
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from engines import warm

MetricValue = Union[float, int, str, None]


class HandOff(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    identity_field: ClassVar[str]  # the field holding the content hash that identifies the hand-off

    def identity(self) -> str:
        """The content hash that identifies this hand-off in cache keys."""
        return getattr(self, self.identity_field)


class PolicyRef(HandOff):
    """The policy iteration i starts from: version i-1 (the checkpoint iteration i-1 committed), 0 = the initial model.

    weights_id: "initial-<sha256 of the folder's files>" for the initial model, "ckpt-<hash of the
    committed files' sha256 list>" for a checkpoint (the same value the update stage computed when it staged
    those files, so a trainer kept warm under it is found again without any re-tagging).
    """

    identity_field = "weights_id"
    version: int = Field(ge=0)
    checkpoint_iteration: Optional[int] = Field(None, ge=1)
    uri: str
    weights_id: str


class Attestation(BaseModel):
    """What a rollout or eval stage proved its engine served (stages/attest.py): the policy version and weights it
    was handed, the digest of the weights the engine held when checked (engines/weights_digest.py), their dtypes,
    and the seconds the check took."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = Field(ge=0)
    weights_id: str
    digest: str
    dtypes: list[str]
    seconds: float = Field(ge=0)


class StageManifest(HandOff):
    iteration: int = Field(ge=1)
    seconds: float = Field(ge=0, description="wall seconds of the stage body in its worker")
    worker: str = Field(description="host:pid of the process that ran the stage")
    engine_builds: int = Field(ge=0, description="engines that process had built when the stage ended")


class ShardsManifest(StageManifest):
    """A stage that wrote shards: where (uri), how many rows, and the shard manifest's content hash."""

    identity_field = "content_hash"
    uri: str
    rows: int
    content_hash: str


class RolloutManifest(ShardsManifest):
    stage: Literal["rollout"] = "rollout"
    policy_version: int
    engine: str
    metrics: dict[str, float] = Field(
        default_factory=dict, description="dynamic sampling's rollout/* accounting; {} when it is off"
    )
    part_workers: list[str] = Field(
        default_factory=list,
        description="host:pid of the process that sampled each part, in part order (pipeline.rollout_parts > 1); "
        "[] when one task run sampled the whole iteration",
    )
    attested: Optional[Attestation] = Field(
        None, description="the policy the engine was proved to serve (stages/attest.py); None only in old records"
    )
    engine_replacements: int = Field(
        0,
        ge=0,
        description="engines built again because the engine's process died in the stage (rollout.engine_replacements)",
    )


class RolloutPartManifest(ShardsManifest):
    """One part of an iteration's rollout (pipeline.rollout_parts > 1): a contiguous slice of the iteration's
    prompts sampled into shards of its own; the merge writes the iteration's RolloutManifest over all parts.

    Identity: the part's shards' content hash, so the merge's cache key changes whenever a part's rows do."""

    stage: Literal["rollout-part"] = "rollout-part"
    part: int = Field(ge=0, description="0-based index of the part")
    parts: int = Field(ge=1, description="how many parts the iteration's prompts were split into")
    prompts: int = Field(ge=1, description="prompts this part sampled")
    policy_version: int
    engine: str
    attested: Optional[Attestation] = Field(
        None, description="the policy the engine was proved to serve (stages/attest.py); None only in old records"
    )


class EvalManifest(ShardsManifest):
    """The eval stage's shards (scored rows of the held-out prompts) and its metrics (eval/reward_mean, eval/accuracy,
    eval/pass@k).

    Identity: the shards' content hash, like the other shard stages (the metrics are a function of the rows)."""

    stage: Literal["eval"] = "eval"
    iteration: int = Field(ge=0, description="0 = the initial policy's eval (eval.before_training)")
    policy_version: int
    engine: str
    metrics: dict[str, float]
    attested: Optional[Attestation] = Field(
        None, description="the policy the engine was proved to serve (stages/attest.py); None only in old records"
    )


class ScoreManifest(ShardsManifest):
    stage: Literal["score"] = "score"
    scorer_identity: str
    cache_hits: int
    cache_misses: int
    computed: int
    reward_mean: float


class UpdateManifest(StageManifest):
    identity_field = "weights_id"
    stage: Literal["update"] = "update"
    checkpoint_uri: str
    experience_uri: str
    weights_id: str = Field(
        description="identity of the staged checkpoint's files (PolicyRef.weights_id once committed)"
    )
    experience_hash: str
    metrics: dict[str, MetricValue]


class CheckpointManifest(StageManifest):
    identity_field = "weights_id"
    stage: Literal["checkpoint"] = "checkpoint"
    uri: str
    weights_id: str


def provenance(started: float) -> dict:
    """The StageManifest fields of a stage body that started at perf_counter() == `started`, in this process."""
    return {
        "seconds": time.perf_counter() - started,
        "worker": warm.worker_tag(),
        "engine_builds": warm.engine_builds(),
    }


STAGE_MANIFESTS: dict[str, type[StageManifest]] = {
    "rollout": RolloutManifest,
    "rollout-part": RolloutPartManifest,
    "score": ScoreManifest,
    "update": UpdateManifest,
    "checkpoint": CheckpointManifest,
    "eval": EvalManifest,
}


# Reward-model training (`ppoflow train-rm`, flows/rm_training.py; bodies in stages/reward_model.py). "iteration" is
# the unit there, as in its checkpoints and metrics.jsonl: rm-prepare runs at 0 (before unit 1), rm-unit u at u, and
# rm-export at the last unit.
class RMPlan(HandOff):
    """The reward-model run's plan (rm-prepare -> every unit and the export): the pairs that were checked and
    tokenized, and how the run's optimizer steps are cut into units.

    Identity: data_id, the hash of the pair files' and the backbone's contents, the rm_train section and run.seed
    (stages/reward_model.data_identity); every other field is a function of those."""

    identity_field = "data_id"
    stage: Literal["rm-prepare"] = "rm-prepare"
    train_pairs: int = Field(ge=1)
    eval_pairs: int = Field(ge=0)
    dropped: dict[str, int] = Field(description="pairs dropped by rm_train.bad_rows / truncation: drop, by reason")
    steps_per_epoch: int = Field(ge=1)
    total_steps: int = Field(ge=1, description="steps_per_epoch x rm_train.epochs")
    steps_per_unit: int = Field(ge=1, description="rm_train.steps_per_unit, or one epoch; at most total_steps")
    units: int = Field(ge=1, description="ceil(total_steps / steps_per_unit)")
    data_id: str

    def unit_steps(self, unit: int) -> tuple[int, int]:
        """(first step, the step after the last) of `unit` (1-based); ValueError outside 1..units."""
        if not 1 <= unit <= self.units:
            raise ValueError(f"unit {unit} is outside 1..{self.units}")
        first = (unit - 1) * self.steps_per_unit
        return first, min(first + self.steps_per_unit, self.total_steps)


class RMCheckpointRef(HandOff):
    """The weights a reward-model unit starts from (-> rm-unit), or the last unit's (-> rm-export): unit 0 is the
    backbone folder, unit u >= 1 the checkpoint unit u committed.

    content_id: "initial-<fingerprint of the folder's files>" for the backbone; "ckpt-<hash of the committed files'
    sha256 list>" for a checkpoint (stages/reward_model.checkpoint_id), the same value as the RMUnitManifest.content_id
    of the unit that committed it, so a trainer kept warm under that id is found again."""

    identity_field = "content_id"
    unit: int = Field(ge=0)
    uri: str
    content_id: str


class RMUnitManifest(StageManifest):
    """One unit of reward-model training (rm-unit -> the flow's metrics row; its committed checkpoint is the next
    unit's RMCheckpointRef). Identity: content_id, the committed checkpoint's (see RMCheckpointRef)."""

    identity_field = "content_id"
    stage: Literal["rm-unit"] = "rm-unit"
    steps: tuple[int, int] = Field(description="(first step, the step after the last) the unit trained")
    metrics: dict[str, MetricValue] = Field(description="rm/* of the unit's steps and the eval, optim/*, timing/step")
    checkpoint_uri: str
    content_id: str


class RMExportManifest(StageManifest):
    """The exported reward model (rm-export): <run>/reward_model/, loadable by `kind: model` and model.critic_path.
    Identity: content_id of the last unit's checkpoint it was copied from."""

    identity_field = "content_id"
    stage: Literal["rm-export"] = "rm-export"
    uri: str
    eval: dict[str, MetricValue] = Field(description="the rm/eval_* metrics of the last unit")
    normalization: Optional[dict[str, float]] = Field(
        None, description="{mean, std} of the eval scores with rm_train.normalize, else None"
    )
    content_id: str
