"""A local reward model: a Hugging Face sequence-classification folder with one label, scored in batches.

What is scored: the text `prompt + response` (RewardBatch.queries, OpenRLHF's convention), tokenized by
the reward model's own tokenizer. A reward model often has another tokenizer than the policy, so token
ids from the rollout cannot be fed to it in general; text is the one path that always works.

Batching: rows are sorted by token length and cut into batches of `batch_size` (optionally also bounded by
a token budget) so rows of similar length share a batch and little padding is computed. Padding is on
the right: with a causal model, pad tokens after a sequence change nothing before them, and the classifier
pools at the last non-pad token (config.pad_token_id), so a row scores the same alone or in a batch up to
float rounding.

Quantization:
- "int8-dynamic": torch.ao.quantization.quantize_dynamic on every nn.Linear (int8 weights, activations
  quantized on the fly). CPU only. torch marks this API deprecated in favour of torchao, which is not in
  the fixed stack; it still works in torch 2.13.
- "bnb-8bit" / "bnb-4bit": loaded through bitsandbytes on a CUDA GPU. Not tested on the CPU machines:
  a clear RewardError is raised when no GPU or no bitsandbytes is present.

Normalisation: a folder written by reward-model training with rm_train.normalize holds
reward_normalization.json {"mean", "std"} (of its eval scores); every score is then returned as
(score - mean) / std, so rewards are centred and of unit scale whatever the head's scale. A malformed file
is a RewardError naming it. Without the file, scores are the head's raw output.

identity: sha256 over the folder's files (weights, config, tokenizer) plus the class name, dtype and
quantization, so new weights are a new identity and a score-cache miss. The file hash is cached per
process, keyed by (path, file names, sizes, mtimes), so it is read once per weights version.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

from engines.rewards.base import RewardBatch, RewardError
from engines.rm.model import NORMALIZATION_FILE
from engines.scoring.batching import token_budget_batches
from ppoflow.fingerprint import folder_fingerprint

_DTYPES = ("float32", "bfloat16", "float16")
_QUANTIZE = ("none", "int8-dynamic", "bnb-8bit", "bnb-4bit")


def _check_reward_model_folder(folder: Path):
    """Load and return the folder's config; RewardError naming the folder unless it is a 1-label classifier."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise RewardError(f"reward model folder {folder} has no config.json (not a Hugging Face model folder)")
    config = AutoConfig.from_pretrained(folder)
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardError(
            f"reward model folder {folder} holds {archs or 'an unknown architecture'}, "
            "not a *ForSequenceClassification model"
        )
    if config.num_labels != 1:
        raise RewardError(
            f"reward model folder {folder} has num_labels={config.num_labels}; "
            "a reward model must have exactly one (a scalar score)"
        )
    return config


def _read_normalization(folder: Path) -> tuple[float, float]:
    """(mean, std) from the folder's reward_normalization.json, or (0, 1) when it has none."""
    path = folder / NORMALIZATION_FILE
    if not path.is_file():
        return 0.0, 1.0
    try:
        values = json.loads(path.read_text())
        mean, std = float(values["mean"]), float(values["std"])
    except (ValueError, KeyError, TypeError) as e:
        raise RewardError(f'{path} must hold {{"mean": number, "std": number}}: {e}') from None
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise RewardError(f"{path}: mean must be finite and std finite and > 0, got mean={mean}, std={std}")
    return mean, std


def _load_model(folder: Path, dtype: str, quantize: str, device: str):
    """from_pretrained with the requested precision and quantization; returns the model in eval mode."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch_dtype = getattr(torch, dtype)
    if quantize.startswith("bnb-"):
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise RewardError(
                f"quantize={quantize!r} needs a CUDA GPU (device={device!r}); on CPU use quantize='int8-dynamic'"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise RewardError(f"quantize={quantize!r} needs the bitsandbytes package: pip install bitsandbytes")
        from transformers import BitsAndBytesConfig

        qconfig = (
            BitsAndBytesConfig(load_in_8bit=True)
            if quantize == "bnb-8bit"
            else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch_dtype)
        )
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=torch_dtype, quantization_config=qconfig, device_map={"": device}
        )
        return model.eval()
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch_dtype).eval()
    if quantize == "int8-dynamic":
        if device != "cpu" or dtype != "float32":
            raise RewardError(
                f"quantize='int8-dynamic' runs on CPU in float32 (got device={device!r}, "
                f"dtype={dtype!r}); on GPU use 'bnb-8bit'"
            )
        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():  # the torchao migration notice; documented in the module docstring
            warnings.simplefilter("ignore", category=(DeprecationWarning, UserWarning))
            return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return model.to(device)


class RewardModelSource:
    """Scores `prompt + response` texts with a local sequence-classification reward model.

    path:         Hugging Face folder (AutoModelForSequenceClassification, num_labels == 1, and tokenizer).
    batch_size:   rows per forward pass. token_budget (optional): also bound rows * longest row per pass.
    dtype:        "float32" | "bfloat16" | "float16". quantize: see the module docstring.
    device:       None = "cuda" when available (and not int8-dynamic), else "cpu".
    max_length:   longest accepted input in tokens; None = the model's max_position_embeddings. A longer
                  input is an error naming the sample, never a silent truncation (that would score
                  another text than the one generated).

    Counters `model_calls` (forward passes) and `samples_scored` let tests and metrics see real work.
    Raises RewardError naming the folder for a folder that is not a one-label classifier.
    """

    reward_inputs: tuple[str, ...] = ()  # the model reads the text only

    def __init__(
        self,
        path: str | Path,
        *,
        name: str = "model",
        batch_size: int = 64,
        dtype: str = "float32",
        quantize: str = "none",
        device: Optional[str] = None,
        max_length: Optional[int] = None,
        token_budget: Optional[int] = None,
    ):
        import torch
        from transformers import AutoTokenizer

        if dtype not in _DTYPES:
            raise RewardError(f"reward model {name!r}: dtype={dtype!r}, allowed: {', '.join(_DTYPES)}")
        if quantize not in _QUANTIZE:
            raise RewardError(f"reward model {name!r}: quantize={quantize!r}, allowed: {', '.join(_QUANTIZE)}")
        if batch_size < 1:
            raise RewardError(f"reward model {name!r}: batch_size must be >= 1, got {batch_size}")
        self.folder = Path(path).expanduser().resolve()
        if not self.folder.is_dir():
            raise RewardError(f"reward model folder {self.folder} does not exist")
        config = _check_reward_model_folder(self.folder)
        if device is None:
            device = "cuda" if torch.cuda.is_available() and quantize != "int8-dynamic" else "cpu"
        self.name, self.batch_size, self.token_budget = name, batch_size, token_budget
        self.dtype, self.quantize, self.device = dtype, quantize, device
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.model = _load_model(self.folder, dtype, quantize, device)
        self.pad_token_id = self._pad_token_id(config)
        self.norm_mean, self.norm_std = _read_normalization(self.folder)
        self.max_length = max_length or getattr(config, "max_position_embeddings", None) or sys.maxsize
        self.identity = hashlib.sha256(
            f"{type(self).__name__}|{folder_fingerprint(self.folder)}|{dtype}|{quantize}".encode()
        ).hexdigest()
        self.model_calls = 0
        self.samples_scored = 0
        self._lock = threading.Lock()  # one forward at a time: the server may call from several threads

    def _pad_token_id(self, config) -> int:
        """The id the classifier treats as padding; set on the model config when only the tokenizer has one."""
        pad = config.pad_token_id if config.pad_token_id is not None else self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise RewardError(
                f"reward model folder {self.folder}: neither config nor tokenizer defines a "
                "pad or eos token, so batched rows cannot be pooled"
            )
        self.model.config.pad_token_id = pad
        return int(pad)

    def _name(self, batch: RewardBatch, i: int) -> str:
        return batch.sample_ids[i] if i < len(batch.sample_ids) else f"sample {i}"

    def _encode(self, batch: RewardBatch) -> list[list[int]]:
        """Token ids of each query, checked against max_length. Shape: B ragged lists."""
        encoded = self.tokenizer(batch.queries, add_special_tokens=True)["input_ids"]
        for i, ids in enumerate(encoded):
            if not ids:
                raise RewardError(f"reward model {self.name!r}: {self._name(batch, i)} tokenizes to nothing")
            if len(ids) > self.max_length:
                raise RewardError(
                    f"reward model {self.name!r}: {self._name(batch, i)} has {len(ids)} tokens, "
                    f"more than max_length={self.max_length}"
                )
        return encoded

    def _forward(self, rows: list[list[int]]) -> list[float]:
        """Scores of right-padded rows. input_ids/attention_mask Shape: (b, longest); 1 = real token."""
        import torch

        longest = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for j, ids in enumerate(rows):
            input_ids[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[j, : len(ids)] = 1
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
            ).logits  # (b, 1)
        self.model_calls += 1
        return ((logits[:, 0].float().cpu() - self.norm_mean) / self.norm_std).tolist()

    def score(self, batch: RewardBatch) -> list[float]:
        """One float per row of `batch`, in order. Raises RewardError naming the sample for an input that
        is empty or too long, or a score that is not finite."""
        if len(batch) == 0:
            return []
        encoded = self._encode(batch)
        budget = self.token_budget or sys.maxsize
        scores: list[float] = [0.0] * len(batch)
        with self._lock:
            for group in token_budget_batches([len(e) for e in encoded], budget, max_batch_rows=self.batch_size):
                for i, value in zip(group, self._forward([encoded[i] for i in group])):
                    if not math.isfinite(value):
                        raise RewardError(f"reward model {self.name!r} returned {value} for {self._name(batch, i)}")
                    scores[i] = value
            self.samples_scored += len(batch)
        return scores
