"""A frozen model's weights as pages of its own safetensors files, handed back to the page cache between uses.

    mapped = map_to_files(model, model_dir)   # None when no parameter could be mapped
    ... model(...) ...                        # the pages fault in from the page cache as the forward reads them
    mapped.release()                          # the process drops them; the kernel's page cache keeps them

Why: the reference model scores once per iteration and then sits idle through the rollout and the update, whose
peaks it adds to. Loaded the usual way its weights are a private copy in the process's anonymous memory (0.5 GB for
SmolLM2-135M in float32) that nothing can take back. Mapped from the file it was loaded from, they are file pages:
resident while a score reads them, dropped from the process after it (`madvise(MADV_DONTNEED)`), faulted in again
from the page cache by the next score, and the kernel may evict them under memory pressure and read them again
from the disk. The values are the same bits: a parameter is mapped only when the file holds it with the same name,
shape and dtype, and equal to what was loaded (compared once).

The mapping is private (copy-on-write, MAP_PRIVATE): a write to a mapped parameter stays in this process and never
reaches the file, and `release` would drop it. So only for weights that never change: the frozen reference. A file
truncated in place while mapped would fault the next read (SIGBUS); ppoflow never rewrites a weights file in place
(checkpoints are written in a scratch folder and moved), and deleting a mapped file is safe (the inode lives on). Files
are read at the offsets safetensors' header names (8-byte length, JSON header, data). Failure modes: a file that is
not safetensors raises ValueError naming it; a parameter that cannot be mapped (another dtype, a precast copy, not
in the files) keeps its loaded copy.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from engines.models import weight_files
from engines.trainer.state import SAFETENSORS_DTYPES

# the format's dtype names, as the checkpoint writer spells them; only floating ones are weights worth mapping
_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items() if dtype.is_floating_point}


class MappedWeights:
    """The mappings a model's parameters now view; `release` drops their pages from this process."""

    def __init__(self, maps: list[mmap.mmap], parameters: int, nbytes: int) -> None:
        self._maps = maps  # kept open for the process's life: the parameters are views of them
        self.parameters = parameters
        self.nbytes = nbytes

    def release(self) -> None:
        """Drop every mapped page from this process's memory. The next read of a parameter faults it in again from
        the page cache (or the disk, if the kernel evicted it): the same bytes, since nothing writes to them."""
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED)


def _file_tensors(path: Path, mapped: mmap.mmap) -> dict[str, torch.Tensor]:
    """{name: tensor viewing `mapped`} for the float tensors of safetensors file `path` (integer ones are skipped)."""
    try:
        (length,) = struct.unpack("<Q", mapped[:8])
        header = json.loads(mapped[8 : 8 + length])
    except (struct.error, ValueError) as e:
        raise ValueError(f"{path} is not a safetensors file: {e}") from e
    data_start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__" or entry["dtype"] not in _DTYPES:
            continue
        dtype = _DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // dtype.itemsize
        if (data_start + begin) % dtype.itemsize or not count:
            continue  # unaligned or empty: torch cannot view it in place
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + begin)
        tensors[name] = flat.view(entry["shape"])
    return tensors


def map_to_files(model: nn.Module, model_dir: str | Path) -> Optional[MappedWeights]:
    """Make each parameter of `model` that its folder's *.safetensors hold bit for bit a view of that file's mapping
    (tied parameters once); None when none could be. Call it on a model loaded from `model_dir` that will not train.
    Returns with the pages already released (the comparison read them)."""
    maps, tensors = [], {}
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        maps.append(mapped)
        tensors.update(_file_tensors(path, mapped))
    count = nbytes = 0
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once, under their first name
            source = tensors.get(name)
            if source is None or source.shape != param.shape or source.dtype != param.dtype:
                continue
            if param.device.type != "cpu" or not torch.equal(source, param.data):
                continue
            param.data = source
            count += 1
            nbytes += source.numel() * source.element_size()
    if not count:
        return None
    weights = MappedWeights(maps, count, nbytes)
    weights.release()
    return weights
