"""The reward model: a decoder backbone with a one-label scalar head, loaded and saved as Hugging Face folders.

`load_reward_model(path)` takes either a causal-LM folder (the policy, or any decoder model: the LM head
is dropped and a new `score` head of shape (1, hidden) is drawn from torch's RNG, so the caller seeds it)
or a one-label `*ForSequenceClassification` folder (a reward model trained before: loaded as it is).
The config's pad_token_id is set from the tokenizer: the classifier pools at the last non-pad token, and
`AutoModelForSequenceClassification` refuses batches without one.

Saved output (`save_reward_model`): an ordinary sequence-classification folder (config.json with
architectures [*ForSequenceClassification], num_labels 1, model.safetensors, tokenizer files), which the
`kind: model` reward source and `model.critic_path` load unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path

NORMALIZATION_FILE = "reward_normalization.json"  # {"mean", "std"}: read by engines/rewards/model.py
SUMMARY_FILE = "rm_train.json"  # the training config and eval metrics, beside the weights


def load_reward_model(path: str | Path, pad_token_id: int, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """A `*ForSequenceClassification` model with num_labels 1, in train mode, on CPU.

    Raises FileNotFoundError when `path` has no config.json; ValueError when it is a classifier with
    another number of labels than 1.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from engines.models import torch_dtype

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"reward-model backbone folder {str(folder)!r} has no config.json "
            f"(rm_train.base_model / model.policy_path: a Hugging Face folder)"
        )
    config = AutoConfig.from_pretrained(folder)
    is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if is_classifier and config.num_labels != 1:
        raise ValueError(
            f"reward-model backbone {str(folder)!r} is a classifier with num_labels="
            f"{config.num_labels}; a reward model has exactly one (a scalar score)"
        )
    # The causal LM's own head is not loaded (and the score head is new): transformers says so at
    # warning level, which is expected here and would only alarm a user.
    hf_logger = logging.getLogger("transformers.modeling_utils")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=1, dtype=torch_dtype(dtype), attn_implementation=attn_implementation
        )
    finally:
        hf_logger.setLevel(level)
    model.config.pad_token_id = pad_token_id
    model.train()
    return model


def save_reward_model(model, tokenizer, folder: str | Path) -> dict[str, str]:
    """save_pretrained (safetensors, hashed as written) + tokenizer into `folder`; returns {file: sha256}."""
    from engines.hf_save import save_pretrained_hashed

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    digests = save_pretrained_hashed(model, out)
    tokenizer.save_pretrained(out)
    return digests
