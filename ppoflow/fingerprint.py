"""The one way ppoflow fingerprints a local file or folder: a sha256 of names and bytes.

    folder_fingerprint(path)   sha256 hex of the regular, non-hidden files directly in a folder (name, then
                               bytes), or of one file; cached per process under the files' (name, size,
                               mtime_ns), so a file rewritten in place is hashed again and an unchanged folder
                               costs a few stat calls

It names what a warm engine was built from (a tokenised dataset, a reward-model or reference folder, the
initial policy), so that new files under the same path rebuild it, and it feeds the stage cache keys and
the score cache's scorer identity: equal bytes give equal fingerprints wherever they live.

Cost: the first call on a folder reads every byte once (~20 s for 14 GB of weights); later calls in the
same process read nothing while the files' sizes and mtimes stay. A missing path raises FileNotFoundError
naming it; an empty folder fingerprints as the hash of nothing (callers that need files say so).
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

_CACHE: dict[tuple, str] = {}
_LOCK = threading.Lock()
_BLOCK = 1 << 20


def _files(path: Path, pattern: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"cannot fingerprint {str(path)!r}: no such file or folder")
    return sorted(p for p in path.glob(pattern) if p.is_file() and not p.name.startswith("."))


def folder_fingerprint(path: str | Path, pattern: str = "*") -> str:
    """sha256 hex (64 chars) of the files matching `pattern` directly in `path` (or of the file `path`)."""
    root = Path(path).expanduser().resolve()
    files = _files(root, pattern)
    stats = tuple((p.name, st.st_size, st.st_mtime_ns) for p in files for st in (p.stat(),))
    key = (str(root), pattern, stats)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode() + b"\0")
        with p.open("rb") as fh:
            for block in iter(lambda: fh.read(_BLOCK), b""):
                digest.update(block)
        digest.update(b"\0")
    value = digest.hexdigest()
    with _LOCK:
        _CACHE[key] = value
    return value


def json_hash(value) -> str:
    """sha256 hex[:20] of a JSON-able value with sorted keys: the identity of a manifest or a config part."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:20]
