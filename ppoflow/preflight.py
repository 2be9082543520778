"""Checks of a run's inputs before its first iteration: cheap, read-only, each error naming the file or bucket.

What is checked (`static_problems`), in the order a run would meet it:
- storage: a local `run.root` is (or can become) a folder; an S3 root's bucket exists (named, with the
  endpoint);
- data: engines.data.check_dataset (path, readable, UTF-8 and JSON line by line for .jsonl, columns,
  non-empty, no empty or whitespace-only prompt, no null label when a reward source is passed labels) --
  not the prompt lengths, which need the tokenizer (flows/preflight.py);
- model folders: the policy, the critic backbone (algorithms with a critic) and every reward-model source:
  config.json parses, tokenizer files are there and their JSON files parse (policy and reward models; a
  tokenizer that still does not load is named at its load, flows/preflight.py), every weights file is listed
  and each safetensors file's header is read and checked against the file's size (a truncated download
  names the file). Headers only: the 8-byte length, the JSON header and the file size; never the tensors;
- `rollout.stop_token_ids` inside the policy's vocabulary;
- function reward sources: the file exists, or the module can be found (nothing is imported or run);
- `model.autocast_dtype=bfloat16` where this process's models would run on a CPU without bfloat16 matmul
  kernels (engines/precision.py): ~16x slower updates, refused with the fix.

Nothing here writes, so a refused start leaves an existing run's files as they were. The Prefect part
(deployments named in `pipeline.stage_pools`) and the tokenised prompt lengths are in flows/preflight.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

from ppoflow.config import ConfigError, PPOFlowConfig, StorageConfig

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


class PreflightError(ConfigError):
    """The run cannot start; one line per problem, each naming the field and the file, row or bucket."""


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


def stop_token_problem(cfg: PPOFlowConfig) -> Optional[str]:
    """A `rollout.stop_token_ids` entry outside the policy's vocabulary (config.json's vocab_size): it could
    never be sampled, so the stop it asks for would silently never happen."""
    try:
        vocab = json.loads((Path(cfg.model.policy_path).expanduser() / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # the folder's own check reports it
    outside = [t for t in cfg.rollout.stop_token_ids if isinstance(vocab, int) and t >= vocab]
    if outside:
        return (
            f"rollout.stop_token_ids: {outside} not below the policy's vocab_size {vocab} "
            f"({cfg.model.policy_path}/config.json)"
        )
    return None


def function_source_problem(spec: str, field: str) -> Optional[str]:
    """A function spec whose file is missing or whose module cannot be found (without importing it)."""
    where = spec.rpartition(":")[0]
    if where.endswith(".py") or "/" in where or "\\" in where:
        if not Path(where).expanduser().is_file():
            return f"{field}: reward function file {where!r} not found (target {spec!r})"
        return None
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError) as e:  # a parent package is missing or fails to import
        return f"{field}: reward function module {where!r} cannot be found (target {spec!r}): {e}"
    return None if found else f"{field}: reward function module {where!r} cannot be found (target {spec!r})"


def hostfile_problem(cfg: PPOFlowConfig) -> Optional[str]:
    """A train.hostfile that cannot be read, does not add up to train.num_ranks, or places ranks on other
    nodes of a run whose storage is not a folder they can mount (S3: each node would fetch and upload its
    own checkpoint files, which the update group does not do)."""
    if cfg.train.hostfile is None:
        return None
    from engines.trainer.hostfile import placement_for
    from storage import fs as fsutil

    try:
        placement = placement_for(cfg.train)
    except ValueError as e:
        return str(e)
    if not placement.remote:
        return None
    try:
        fs, _ = fsutil.resolve(cfg.run.root, cfg.storage)
    except (ValueError, ImportError):
        return None  # storage_problem names it
    if not fsutil.is_local(fs):
        return (
            f"train.hostfile places ranks on {len(placement.nodes)} nodes but run.root={cfg.run.root!r} is not "
            f"a local folder: several nodes need the run's storage on a filesystem every node mounts at the same "
            f"path"
        )
    return None


def storage_problem(cfg: PPOFlowConfig) -> Optional[str]:
    """A root that cannot hold the run: a local path that is a file or under a read-only folder, or an S3
    root whose bucket does not exist or cannot be reached (named with the endpoint)."""
    from storage import fs as fsutil

    try:
        fs, root = fsutil.resolve(cfg.run.root, cfg.storage)
    except (ValueError, ImportError) as e:
        return f"run.root={cfg.run.root!r}: {e}"
    if not fsutil.is_local(fs):
        problem = bucket_problem(cfg.run.root, cfg.storage, missing_hint=" (create it first)")
        return problem and f"run.root={cfg.run.root!r}: {problem}"
    existing = Path(root)
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"run.root={cfg.run.root!r}: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"run.root={cfg.run.root!r}: {existing} is not writable by this user"
    return None


def bucket_problem(url: str, storage_cfg: StorageConfig, missing_hint: str = "") -> Optional[str]:
    """Why the bucket of the S3 URL `url` cannot be used: it does not exist (+ `missing_hint`), access is denied,
    or it cannot be reached (each naming the bucket and the endpoint); None when it answers, and for a local path."""
    from storage import fs as fsutil

    fs, path = fsutil.resolve(url, storage_cfg)
    if fsutil.is_local(fs):
        return None
    bucket = path.split("/", 1)[0]
    endpoint = storage_cfg.endpoint_url or "AWS"
    # HEAD on the bucket, not fs.exists: s3fs's exists answers False for an endpoint that does not answer too.
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
        return None
    except FileNotFoundError:
        return f"bucket {bucket!r} does not exist at {endpoint}{missing_hint}"
    except PermissionError as e:
        return f"access to bucket {bucket!r} at {endpoint} denied ({e}); check credentials"
    except Exception as e:  # an endpoint that does not answer, bad credentials: say which bucket and endpoint
        return f"cannot reach bucket {bucket!r} at {endpoint}: {type(e).__name__}: {e}"


def lora_target_problem(cfg: PPOFlowConfig) -> str | None:
    """model.lora.target_modules that are not Linear modules of the policy, or modules_to_save it cannot train
    (engines/trainer/lora.check_targets: read from config.json on the meta device, no weights loaded), or None."""
    if cfg.model.lora is None or not os.path.isfile(os.path.join(cfg.model.policy_path, "config.json")):
        return None  # no LoRA, or a missing folder model_folder_problems already names
    from engines.trainer.lora import check_targets

    try:
        check_targets(cfg.model.policy_path, cfg.model.lora)
    except ValueError as e:
        return str(e)
    return None


def precision_problem(cfg: PPOFlowConfig) -> str | None:
    """model.autocast_dtype=bfloat16 refused on a CPU without bfloat16 matmul kernels (engines/precision.py),
    when a stage whose models take the setting runs in this process. Stages that all run on pools or task
    workers (pipeline.stage_pools / stage_workers) compute on their own machines: not judged from here."""
    remote = set(cfg.pipeline.stage_pools or {}) | set(cfg.pipeline.stage_workers)
    if cfg.model.autocast_dtype is None or remote >= {"rollout", "score", "update", "eval"}:
        return None
    from engines.precision import cpu_autocast_problem

    return cpu_autocast_problem(cfg.model.autocast_dtype)


def label_readers(cfg: PPOFlowConfig) -> list[str]:
    """The reward sources that are passed each sample's label ("reward.sources.0 (function my.py:fn)"), from
    each kind's `reward_inputs`: function and remote sources are, a reward model reads the text only."""
    from engines.rewards.function import FunctionRewardSource
    from engines.rewards.model import RewardModelSource
    from engines.rewards.remote import RemoteRewardSource

    kinds = {"function": FunctionRewardSource, "model": RewardModelSource, "remote": RemoteRewardSource}
    return [
        f"reward.sources.{i} ({source.kind} {source.target})"
        for i, source in enumerate(cfg.reward.sources)
        if "label" in kinds[source.kind].reward_inputs
    ]


def static_problems(cfg: PPOFlowConfig) -> list[str]:
    """Every problem of the storage root, the data, the model folders and the reward sources (see module doc)."""
    from engines.data import DataError, check_dataset

    problems = [p for p in [storage_problem(cfg)] if p]
    readers = label_readers(cfg)
    try:
        check_dataset(cfg.data, readers)
    except DataError as e:
        problems.append(f"data.path: {e}")
    if cfg.eval.data_path:  # the held-out set, read with data's columns (its message says data.path: name eval's)
        try:
            check_dataset(cfg.data.model_copy(update={"path": cfg.eval.data_path}), readers)
        except DataError as e:
            problems.append(f"eval.data_path: {e}")
    problems += model_folder_problems(cfg.model.policy_path, "model.policy_path")
    problems += [p for p in [stop_token_problem(cfg), lora_target_problem(cfg), hostfile_problem(cfg)] if p]
    problems += [p for p in [precision_problem(cfg)] if p]
    if cfg.algo.uses_critic and cfg.model.critic_path:
        problems += model_folder_problems(cfg.model.critic_path, "model.critic_path", need_tokenizer=False)
    for i, source in enumerate(cfg.reward.sources):
        field = f"reward.sources.{i}.target"
        if source.kind == "model":
            problems += model_folder_problems(source.target, field)
        elif source.kind == "function":
            problems += [p for p in [function_source_problem(source.target, field)] if p]
    return problems


def check_static(cfg: PPOFlowConfig) -> None:
    """Raise PreflightError listing every problem `static_problems` finds; return quietly otherwise."""
    problems = static_problems(cfg)
    if problems:
        raise PreflightError(format_problems(cfg, problems))


def format_problems(cfg: PPOFlowConfig, problems: list[str]) -> str:
    lines = "\n".join(f"  {p}" for p in problems)
    return f"run {cfg.run.name!r} cannot start ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n{lines}"
