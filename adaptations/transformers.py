"""transformers, adapted (written against transformers 5.19.0).

`save_pretrained` writes each safetensors file through the module-level name
`transformers.modeling_utils.safe_save_file` (safetensors' `save_file`) and takes no writer of the caller's: no
way to hash a file as it is written, or to write it past the page cache. `safetensors_writer` swaps that name for
the duration of one save. engines/hf_save.py uses it to get every file's sha256 from the write itself.
tests/unit/test_adaptations_transformers.py fails once save_pretrained takes a writer or returns the files it
wrote (then this can go), or stops writing through that name (then the swap would silently do nothing).

Loading a GGUF model folder (engines/pretrained.py: `ppoflow models fetch`) parses the GGUF file once per
`load_gguf_checkpoint` call, three per folder, and rebuilds the same tensor-name map once per submodule.
`gguf_read_once` memoizes both for the duration of one conversion (SmolLM2-135M-Instruct: 22.4-23.0 CPU-s -> 13.0-13.5,
the same bytes written).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

_lock = threading.Lock()


@contextlib.contextmanager
def safetensors_writer(write: Callable[..., None]) -> Iterator[bool]:
    """Within the block, transformers' `save_pretrained` called from THIS thread writes each safetensors file with
    `write(tensors, filename, metadata=None)`; another thread saving meanwhile gets safetensors' own writer.

    Yields True when swapped; False, changing nothing, when transformers has no module-level `safe_save_file`
    (another version: the caller then gets safetensors' writer and should not expect `write` to run). Saves that
    swap are serialised by a lock (the name is module-wide). Exceptions from `write` propagate out of
    save_pretrained unchanged; the original name is restored in every case.
    """
    import transformers.modeling_utils as hf_modeling

    original = getattr(hf_modeling, "safe_save_file", None)
    if original is None:
        yield False
        return
    owner = threading.get_ident()

    def routed(tensors, filename, metadata=None):
        if threading.get_ident() != owner:
            return original(tensors, filename, metadata=metadata)
        return write(tensors, filename, metadata=metadata)

    with _lock:
        hf_modeling.safe_save_file = routed
        try:
            yield True
        finally:
            hf_modeling.safe_save_file = original


_gguf_lock = threading.Lock()


@contextlib.contextmanager
def gguf_read_once() -> Iterator[bool]:
    """Within the block, transformers' GGUF loading parses each GGUF file once, and builds the GGUF-to-HF tensor name
    map of an (architecture, layer count) once, however many times it is asked.

    Loading one GGUF model folder as transformers does it (`AutoTokenizer`, then `AutoModelForCausalLM`, which reads
    the config and then the weights) calls `load_gguf_checkpoint` three times, and each builds a new
    `gguf.GGUFReader`: a Python walk over every metadata field, SmolLM2's 49,152-token vocabulary included. Matching
    the weights' names then calls `gguf.get_tensor_name_map` once per submodule of the model (397 for SmolLM2), every
    call building the same map. Under cProfile the readers took 13.9 s and the maps 6.0 s of a 36.5 s conversion;
    unprofiled, the whole conversion is 22.4-23.0 CPU-s upstream and 13.0-13.5 with this (module docstring). Both
    are read-only here: the reader is a memory map of a file opened for reading, and transformers only looks names
    up in the map.

    Yields True when swapped; False, changing nothing, when the `gguf` package lacks either name. transformers 5.19
    imports both from `gguf` inside the functions that use them, at call time, which is what lets the swap of the
    module's names reach them. The names are restored on exit; loads that swap are serialised by a lock.
    tests/unit/test_adaptations_transformers.py fails once transformers stops reading through those names (the swap
    would then do nothing) and shows the counts with and without it.
    """
    import functools
    import os

    import gguf

    reader_class = getattr(gguf, "GGUFReader", None)
    name_map = getattr(gguf, "get_tensor_name_map", None)
    if reader_class is None or name_map is None:
        yield False
        return
    readers: dict = {}

    def read_once(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    with _gguf_lock:
        gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield True
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
