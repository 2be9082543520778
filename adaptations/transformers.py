"""transformers, adapted (written against transformers 5.19.0).

`save_pretrained` writes each safetensors file through the module-level name
`transformers.modeling_utils.safe_save_file` (safetensors' `save_file`) and takes no writer of the caller's: no
way to hash a file as it is written, or to write it past the page cache. `safetensors_writer` swaps that name for
the duration of one save. engines/hf_save.py uses it to get every file's sha256 from the write itself.
tests/unit/test_adaptations_transformers.py fails once save_pretrained takes a writer or returns the files it
wrote (then this can go), or stops writing through that name (then the swap would silently do nothing).
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
