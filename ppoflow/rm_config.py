"""The `rm_train` section of the one config: reward-model (Bradley-Terry) training, `ppoflow train-rm`.

The other sections are reused where they fit, so a reward-model run is described like a PPO run:
  run      name, root, seed, keep_checkpoints (run.iterations is not used: units come from epochs below)
  storage  where checkpoints and the trained model go (local or S3)
  model    dtype, autocast_dtype, attn_implementation, gradient_checkpointing (model.policy_path is the
           backbone when rm_train.base_model is None)
  train    zero_stage, weight_decay, warmup_steps, lr_schedule, max_grad_norm (the optimizer's settings)
What only reward-model training has is here: the preference data, the pair batch sizes, the learning rate,
how long to train, what to do with bad rows, and the optional score normalisation.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RMTrainConfig(BaseModel):
    # Unknown keys are errors, as in every other section (ppoflow/config/base.py's _Section).
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    base_model: Optional[str] = Field(
        None,
        description=(
            "Backbone folder: a causal LM (a new scalar head is added) or a sequence-classification model; None ="
            " model.policy_path."
        ),
    )
    data_path: str = Field(
        "./runs/_data/digits-preferences",
        description=("Preference pairs: a datasets folder (save_to_disk), or a .jsonl/.parquet file."),
    )
    prompt_key: str = Field(
        "prompt", description=("Column with the prompt: text, or a list of chat messages ({role, content}).")
    )
    chosen_key: str = Field(
        "chosen", description=("Column with the preferred response: text, or a list of chat messages.")
    )
    rejected_key: str = Field(
        "rejected", description=("Column with the dispreferred response: text, or a list of chat messages.")
    )
    margin_key: Optional[str] = Field(
        None, description=("Column with a per-pair margin m in -log sigmoid(r_chosen - r_rejected - m); None = 0.")
    )
    eval_path: Optional[str] = Field(
        None, description=("Held-out pairs in a second file or folder; None = split off eval_fraction of data_path.")
    )
    eval_fraction: float = Field(
        0.1,
        ge=0,
        lt=1,
        description=("Share of data_path's pairs held out for evaluation when eval_path is None (a seeded split)."),
    )
    max_length: int = Field(256, ge=2, description="Longest prompt + response in tokens.")
    truncation: Literal["error", "drop", "truncate_left"] = Field(
        "error",
        description=(
            "A pair longer than max_length: error naming the row, drop it (counted), or cut tokens from the "
            "prompt's start."
        ),
    )
    bad_rows: Literal["error", "drop"] = Field(
        "error",
        description=(
            "A row with a missing field or chosen == rejected: error naming the row, or drop it (counted in the "
            "metrics)."
        ),
    )
    epochs: int = Field(1, ge=1, description="Passes over the training pairs.")
    steps_per_unit: Optional[int] = Field(
        None,
        ge=1,
        description=("Optimizer steps per task run (one cached, resumable unit); None = one epoch per unit."),
    )
    batch_size: int = Field(
        32,
        ge=1,
        description=(
            "Pairs per optimizer step (over all ranks); an epoch's leftover pairs (fewer than this) are skipped, "
            "a different few each epoch."
        ),
    )
    micro_batch_size: int = Field(
        16, ge=1, description=("Pairs per forward/backward on each rank (2x rows: chosen and rejected in one forward).")
    )
    lr: float = Field(
        1e-4,
        gt=0,
        description=("Learning rate (AdamW); warm-up, schedule, decay and clipping come from the train section."),
    )
    normalize: bool = Field(
        False,
        description=(
            "Store the mean/std of the eval scores with the model; the `kind: model` reward source then returns "
            "(score - mean) / std."
        ),
    )

    @model_validator(mode="after")
    def _check_batches(self) -> "RMTrainConfig":
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"rm_train.micro_batch_size={self.micro_batch_size} must divide rm_train.batch_size={self.batch_size}"
            )
        return self
