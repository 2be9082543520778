"""Read-only checks of a Hugging Face model folder, file by file, before anything loads it.

`model_folder_problems(path, field)`: config.json parses; tokenizer files are there and their JSON files parse;
every weights file is listed and each safetensors file's header is read and checked against the file's size
(a truncated download names the file). Headers only: the 8-byte length, the JSON header and the file size;
never the tensors. Torch-free, so the preflight (flows/preflight_static.py) and the tokenizer's own loader
(engines/models.py, to name a corrupt file) share it without importing a model stack.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

# The largest safetensors header we accept (the format's own reader refuses more than 100 MB).
_MAX_HEADER_BYTES = 100 * 2**20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# The JSON files a tokenizer is loaded from (transformers reads each that is there).
_TOKENIZER_JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)


def safetensors_problem(path: str) -> Optional[str]:
    """None when `path`'s header parses and the tensors it describes end exactly at the file's end.

    Layout (safetensors): 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}, then the tensor bytes; the largest `end` plus 8 + N
    is the file's size. A shorter file is truncated, a longer one has trailing bytes.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path}: {size} bytes, too short for a safetensors header (truncated?)"
        header_len = int.from_bytes(head, "little")
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            return f"{path}: header length {header_len} bytes does not fit the file's {size} bytes (truncated?)"
        try:
            header = json.loads(f.read(header_len))
            ends = [int(info["data_offsets"][1]) for name, info in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError) as e:
            return f"{path}: the safetensors header is not valid ({type(e).__name__}: {e})"
    expected = 8 + header_len + max(ends, default=0)
    if expected != size:
        what = "truncated" if size < expected else "longer than its header says"
        return f"{path}: {size} bytes but its header describes {expected} bytes ({what})"
    return None


def tokenizer_json_problem(folder: str | Path) -> Optional[str]:
    """The first tokenizer JSON file of a model folder that is not a JSON object (a truncated or corrupt
    download), named with the parser's line and column; None when each present one parses. The whole file is
    parsed (tokenizer.json: a few MB, ~0.1 s)."""
    for name in _TOKENIZER_JSON_FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            if not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
                return f"{path}: not a JSON object, so the tokenizer cannot load"
        except (ValueError, UnicodeDecodeError) as e:
            return f"{path}: not valid JSON ({e}), so the tokenizer cannot load"
    return None


def _weight_files(folder: Path) -> tuple[list[Path], Optional[str]]:
    """The safetensors files a folder's weights consist of, or a problem: none at all, a shard the index
    lists missing. A folder with only pytorch_model.bin passes with nothing to check (no header to read)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            return [], f"{index}: not a safetensors index ({type(e).__name__}: {e})"
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return [], f"{index} lists shards that are missing: {missing}"
        return [folder / s for s in shards], None
    found = sorted(folder.glob("*.safetensors"))
    if found or (folder / "pytorch_model.bin").is_file():
        return found, None
    return [], f"{folder}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"


def model_folder_problems(path: str, field: str, need_tokenizer: bool = True) -> list[str]:
    """Problems of a Hugging Face model folder, each prefixed with the config field that names it."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return [f"{field}: model folder {path!r} not found"]
    problems = []
    config = folder / "config.json"
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            problems.append(f"{config}: not a JSON object")
    except FileNotFoundError:
        problems.append(f"{config} is missing (a Hugging Face model folder has one)")
    except (ValueError, UnicodeDecodeError) as e:
        problems.append(f"{config}: not valid JSON ({e})")
    if need_tokenizer and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        problems.append(f"{folder}: no tokenizer files (one of {', '.join(_TOKENIZER_FILES)})")
    elif need_tokenizer and (problem := tokenizer_json_problem(folder)):
        problems.append(problem)
    files, problem = _weight_files(folder)
    problems += [problem] if problem else []
    problems += [p for p in map(safetensors_problem, map(str, files)) if p]
    return [f"{field}: {p}" for p in problems]
