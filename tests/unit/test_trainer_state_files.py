"""engines/trainer/state.py's safetensors writer against the safetensors library's own reader, and the
hashes it returns against hashlib over the written bytes."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from engines.trainer.state import load_nested, save_nested, write_safetensors


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_written_file_reads_back_with_the_safetensors_library(tmp_path):
    base = torch.randn(3, 4)
    tensors = {
        "f32": base,
        "bf16": torch.randn(5).bfloat16(),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(7),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 2),
        "mask": torch.tensor([True, False, True]),
        "transposed": torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),  # not contiguous
        "row_of_f32": base[1],  # shares memory with "f32" (safetensors' own writer refuses this)
    }
    path = tmp_path / "x.safetensors"
    digest = write_safetensors(tensors, path)
    assert digest == _sha256(path)
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name


def test_unsupported_dtype_is_named(tmp_path):
    with pytest.raises(TypeError, match="'z'.*complex64"):
        write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")


def test_save_nested_returns_file_hashes_and_round_trips(tmp_path):
    state = {"state": {0: {"exp_avg": torch.randn(4), "step": torch.tensor(3.0)}}, "lr": 1e-3, "betas": (0.9, 0.99)}
    hashes = save_nested(state, tmp_path, "opt")
    assert hashes == {
        "opt.safetensors": _sha256(tmp_path / "opt.safetensors"),
        "opt.json": _sha256(tmp_path / "opt.json"),
    }
    back = load_nested(tmp_path, "opt")
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["betas"] == (0.9, 0.99) and back["lr"] == 1e-3
