"""Trainer state in open formats: nested state dicts split into safetensors (tensors) + JSON (the rest).

`save_nested(obj, folder, stem)` walks a nested dict/list and writes every tensor leaf to
`<stem>.safetensors` under a path key ("base_optimizer_state/state/0/exp_avg") and the structure with
every other leaf to `<stem>.json` (a tensor leaf is recorded as {"__tensor__": key}). `load_nested` inverts
it exactly. Leaves that are neither JSON values nor tensors (e.g. a torch.dtype) are written as tagged
strings that load back to the same object; anything else is an error naming its path, never pickled.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from engines.trainer.direct_io import SequentialWriter

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DTYPE = "__torch_dtype__"
_INT_KEYS = "__int_keys__"


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = path.lstrip("/") or "root"
        tensors[key] = obj.detach().cpu().contiguous()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        keys = list(obj)
        if all(isinstance(k, int) for k in keys) and keys:  # torch optimizer state is keyed by param index
            return {_INT_KEYS: [[k, _encode(obj[k], f"{path}/{k}", tensors)] for k in keys]}
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"state at {path or '/'}: keys must be all str or all int, got {keys[:5]}")
        return {k: _encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, torch.dtype):
        return {_DTYPE: str(obj).removeprefix("torch.")}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"state at {path or '/'} is a {type(obj).__name__}: not a tensor or JSON value (no pickle)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _TUPLE in obj:
        return tuple(_decode(v, tensors) for v in obj[_TUPLE])
    if _DTYPE in obj:
        return getattr(torch, obj[_DTYPE])
    if _INT_KEYS in obj:
        return {int(k): _decode(v, tensors) for k, v in obj[_INT_KEYS]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def is_open_format(value: Any) -> bool:
    """True when save_nested can store `value` (tensors, JSON values, dtypes, nested dicts/lists/tuples)."""
    try:
        _encode(value, "", {})
    except TypeError:
        return False
    return True


# Below this, a file's page-cache copy costs little and O_DIRECT's staging copy gains nothing.
DIRECT_MIN_BYTES = 16 << 20
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: Optional[dict[str, str]] = None
) -> str:
    """Write `tensors` as a safetensors file at `path`; returns the sha256 (hex) of the bytes written.

    Layout (the safetensors format): 8-byte little-endian header length, a JSON header
    {name: {dtype, shape, data_offsets}} padded with spaces to 8 bytes, then each tensor's raw bytes in
    header order. Each tensor's memory goes straight to the file and into the hash: no second copy of the
    whole state is built (safetensors' own writer serialises into one buffer first), tensors sharing memory
    are simply written twice, and the checkpoint need not read the file back to hash it.
    Files of DIRECT_MIN_BYTES or more bypass the page cache (engines/trainer/direct_io.py): optimizer state
    and model weights, read again only on resume or by another process.
    metadata: extra string entries for the header's __metadata__ (which always has "format": "pt").
    Raises TypeError naming a tensor of a dtype the format has no name for.
    """
    views, header, offset = [], {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + raw.numel()],
        }
        views.append(raw.numpy())
        offset += raw.numel()
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    with SequentialWriter(path, direct=offset >= DIRECT_MIN_BYTES) as f:
        for chunk in (len(encoded).to_bytes(8, "little"), encoded, *views):
            f.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def save_nested(obj: Any, folder: str | Path, stem: str) -> dict[str, str]:
    """Write `obj` as folder/stem.safetensors + folder/stem.json; returns {file name: sha256 of its bytes}.

    TypeError names a leaf that is neither a tensor nor a JSON value.
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(obj, "", tensors)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(structure).encode()
    (out / f"{stem}.json").write_bytes(text)
    return {
        f"{stem}.safetensors": write_safetensors(tensors, out / f"{stem}.safetensors"),
        f"{stem}.json": hashlib.sha256(text).hexdigest(),
    }


def load_nested(folder: str | Path, stem: str) -> Any:
    """Inverse of save_nested. FileNotFoundError names the missing file."""
    from safetensors.torch import load_file

    base = Path(folder)
    for suffix in (".json", ".safetensors"):
        if not (base / f"{stem}{suffix}").is_file():
            raise FileNotFoundError(f"trainer state file {base / (stem + suffix)} is missing")
    tensors = load_file(str(base / f"{stem}.safetensors"))
    return _decode(json.loads((base / f"{stem}.json").read_text()), tensors)


def seed_rng(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (torch's on every device) from `seed`.

    What a fresh trainer does, so that the generator states it checkpoints (rng_state) depend on the run alone,
    not on what the process drew before: every rank of a group, and a rerun of the same config, then commit the
    same bytes. numpy takes seeds in [0, 2**32), so `seed` is reduced modulo 2**32 for it."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states (torch's as a uint8 tensor)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() returned (after a save_nested / load_nested round trip)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
