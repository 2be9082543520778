"""Checks of a run's inputs before its first iteration: cheap, read-only, each error naming the file or bucket.

What is checked (`static_problems`), in the order a run would meet it:
- storage: a local `run.root` is (or can become) a folder; an S3 root's bucket exists (named, with the
  endpoint);
- data: engines.data.check_dataset (path, readable, UTF-8 and JSON line by line for .jsonl, columns,
  non-empty, no empty or whitespace-only prompt, no null label when a reward source is passed labels) --
  not the prompt lengths, which need the tokenizer (flows/preflight.py);
- model folders: the policy, the critic backbone (algorithms with a critic) and every reward-model source
  (engines/model_files.py): config.json parses, tokenizer files are there and their JSON files parse (policy and
  reward models; a tokenizer that still does not load is named at its load, flows/preflight.py), every weights
  file is listed and each safetensors file's header is checked against the file's size;
- `rollout.stop_token_ids` inside the policy's vocabulary;
- a multi-turn conversation's `max_total_tokens` within the policy's context (flows/preflight_limits.py);
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

from engines.model_files import model_folder_problems
from flows.preflight_limits import limit_problems
from ppoflow.config import ConfigError, PPOFlowConfig, StorageConfig


class PreflightError(ConfigError):
    """The run cannot start; one line per problem, each naming the field and the file, row or bucket."""


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
    from engines.rewards.environment import EnvironmentRewardSource
    from engines.rewards.function import FunctionRewardSource
    from engines.rewards.model import RewardModelSource
    from engines.rewards.remote import RemoteRewardSource

    kinds = {
        "function": FunctionRewardSource,
        "model": RewardModelSource,
        "remote": RemoteRewardSource,
        "environment": EnvironmentRewardSource,
    }
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
    problems += [p for p in [stop_token_problem(cfg), lora_target_problem(cfg)] if p]
    problems += [p for p in [precision_problem(cfg)] if p]
    if cfg.algo.uses_critic and cfg.model.critic_path:
        problems += model_folder_problems(cfg.model.critic_path, "model.critic_path", need_tokenizer=False)
    for i, source in enumerate(cfg.reward.sources):
        field = f"reward.sources.{i}.target"
        if source.kind == "model":
            problems += model_folder_problems(source.target, field)
        elif source.kind == "function":
            problems += [p for p in [function_source_problem(source.target, field)] if p]
    if cfg.rollout.environment is not None:
        problems += [p for p in [environment_problem(cfg.rollout.environment.source)] if p]
    problems += limit_problems(cfg)  # a conversation longer than the policy's context (preflight_limits.py)
    return [with_working_folder(p, cfg) for p in problems]


def with_working_folder(problem: str, cfg: PPOFlowConfig) -> str:
    """`problem` with the folder a relative path of its field was resolved against, when it names one that is not
    found: a deployment's run resolves `./runs/...` in its own working folder, not where the user typed it."""
    paths = {"data.path": cfg.data.path, "eval.data_path": cfg.eval.data_path}
    paths |= {"model.policy_path": cfg.model.policy_path, "model.critic_path": cfg.model.critic_path}
    for field, path in paths.items():
        relative = path and "://" not in path and not os.path.isabs(os.path.expanduser(path))
        if relative and problem.startswith(f"{field}:") and "not found" in problem:
            return f"{problem} (a relative path, resolved against the working folder {os.getcwd()})"
    return problem


def environment_problem(source: str) -> Optional[str]:
    """rollout.environment.source that cannot be imported (the loader's error names the spec), else None."""
    from engines.environments.loader import load_environment_factory

    try:
        load_environment_factory(source)
    except (ValueError, OSError, ImportError, AttributeError, TypeError) as e:
        return f"rollout.environment.source: {e}"
    return None


def check_static(cfg: PPOFlowConfig) -> None:
    """Raise PreflightError listing every problem `static_problems` finds; return quietly otherwise."""
    problems = static_problems(cfg)
    if problems:
        raise PreflightError(format_problems(cfg, problems))


def format_problems(cfg: PPOFlowConfig, problems: list[str]) -> str:
    lines = "\n".join(f"  {p}" for p in problems)
    return f"run {cfg.run.name!r} cannot start ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n{lines}"
