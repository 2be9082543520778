"""reasoning-gym's task generators as a ppoflow dataset: `data.reasoning_gym` in the config, a .jsonl on disk.

    generate_rows(spec) -> (train rows, held-out rows)   each row {"prompt", "label", "data_source"}
    materialize(cfg) -> cfg                               writes the files once, points data.path (and
                                                          eval.data_path when eval_size > 0) at them

reasoning-gym (PyPI `reasoning-gym`) generates ~100 procedural tasks offline (basic_arithmetic, chain_sum,
leg_counting, gsm_symbolic, ...) and scores answers with each task's own `score_answer`; ppoflow uses both
as they are (engines/rewards/reasoning_tasks.py holds the reward side). A row is:
- prompt: `prompt_template` with {question} filled in (the chat template is applied later, by
  model.apply_chat_template, as for any dataset);
- label: the task's entry as JSON ({"question", "answer", "metadata"}), what `score_answer` needs;
- data_source: the task's name, so the reward function knows which scorer to call.

Determinism and held-out rows: reasoning-gym draws entry i of a dataset with seed s from Random(s + i), so
the training rows are entries s .. s + size - 1 and the held-out rows start at eval_seed (default s + size:
no random stream is shared). Rows whose question also appears among the training rows (small task spaces
repeat questions) are left out of the held-out set and more are drawn, up to 8x eval_size draws; too few
distinct questions is an error naming data.reasoning_gym.

Files: <root>/_data/reasoning-gym/<task>-<hash of the spec>/{train,eval}.jsonl when run.root is a local
folder, else under <local cache>/data/ (storage.fs.local_cache_root); written to a temporary name and renamed, so
a reader never sees half a file; an existing file is reused (same spec, same bytes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from ppoflow.config import ConfigError, PPOFlowConfig, ReasoningGymConfig
from ppoflow.fingerprint import json_hash
from storage.fs import is_local, local_cache_root, resolve

_EVAL_DRAWS = 8  # held-out draws per wanted row at most, before giving up on a small task space


def _dataset(spec: ReasoningGymConfig, seed: int, size: int):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if spec.task not in DATASETS:
        close = sorted(n for n in DATASETS if spec.task.split("_")[0] in n)[:8]
        raise ConfigError(
            f"data.reasoning_gym.task = {spec.task!r}: not a reasoning-gym task"
            f"{' (close: ' + ', '.join(close) + ')' if close else ''}; the {len(DATASETS)} tasks are "
            f"reasoning_gym.factory.DATASETS"
        )
    try:
        return reasoning_gym.create_dataset(spec.task, seed=seed, size=size, **spec.config)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"data.reasoning_gym.config = {spec.config!r} for task {spec.task!r}: {e}") from None


def _row(spec: ReasoningGymConfig, entry: dict[str, Any]) -> dict[str, str]:
    return {
        "prompt": spec.prompt_template.format(question=entry["question"]),
        "label": json.dumps(entry, sort_keys=True),
        "data_source": spec.task,
    }


def generate_rows(spec: ReasoningGymConfig) -> tuple[list[dict], list[dict]]:
    """The training rows and the held-out rows of `spec` (see the module docstring); pure, deterministic."""
    train = [_row(spec, e) for e in _dataset(spec, spec.seed, spec.size)]
    if not spec.eval_size:
        return train, []
    seen = {r["prompt"] for r in train}
    eval_seed = spec.eval_seed if spec.eval_seed is not None else spec.seed + spec.size
    held: list[dict] = []
    for entry in _dataset(spec, eval_seed, spec.eval_size * _EVAL_DRAWS):
        row = _row(spec, entry)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            held.append(row)
            if len(held) == spec.eval_size:
                return train, held
    raise ConfigError(
        f"data.reasoning_gym: task {spec.task!r} with config {spec.config} gave only {len(held)} held-out "
        f"questions not among its {spec.size} training rows in {spec.eval_size * _EVAL_DRAWS} draws; lower "
        f"data.reasoning_gym.eval_size or size, or widen the task's config"
    )


def data_dir(cfg: PPOFlowConfig) -> Path:
    """Where generated datasets live: <root>/_data/reasoning-gym for a local root, else the local cache."""
    fs, root = resolve(cfg.run.root, cfg.storage)
    base = Path(root) / "_data" if is_local(fs) else Path(local_cache_root(cfg.storage.local_cache_dir)) / "data"
    return base.resolve() / "reasoning-gym"


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(partial, path)


def _materialize_spec(cfg: PPOFlowConfig, spec: ReasoningGymConfig) -> tuple[Path, Optional[Path]]:
    """The train (and, with eval_size, eval) files of the plain spec `spec`, written now when missing."""
    folder = data_dir(cfg) / f"{spec.task}-{json_hash(spec.model_dump(mode='json'))[:12]}"
    train_path, eval_path = folder / "train.jsonl", folder / "eval.jsonl"
    if not train_path.is_file() or (spec.eval_size and not eval_path.is_file()):
        train, held = generate_rows(spec)
        _write_jsonl(train_path, train)
        if held:
            _write_jsonl(eval_path, held)
    return train_path, (eval_path if spec.eval_size else None)


def level_train_path(cfg: PPOFlowConfig, level: int) -> Path:
    """The training rows of curriculum level `level` (engines/curriculum.py), written now when missing: the file a
    plain spec with that level's task config would have, so a level's rows are the same in every run."""
    from engines.curriculum import level_spec

    return _materialize_spec(cfg, level_spec(cfg.data.reasoning_gym, level))[0]


def materialize(cfg: PPOFlowConfig) -> PPOFlowConfig:
    """`cfg` itself when data.reasoning_gym is unset; else a copy whose data.path (and eval.data_path, when
    eval_size > 0) name the generated files, written now if missing. ConfigError names a bad task or config.

    With data.reasoning_gym.curriculum: every level from start_level to the top one is written (level_train_path),
    data.path names the start level's rows (the rollout picks each iteration's level: stages/curriculum_state.py),
    and the held-out rows are at target_level, none among that level's training rows (questions of other levels
    differ in their terms or digits, unless range_mode inclusive makes the levels overlap)."""
    from engines.curriculum import level_spec

    spec = cfg.data.reasoning_gym
    if spec is None:
        return cfg
    plan = spec.curriculum
    if plan is None:
        train_path, eval_path = _materialize_spec(cfg, spec)
    else:
        train_path = level_train_path(cfg, plan.start_level)
        for level in range(plan.start_level + 1, plan.top_level + 1):
            level_train_path(cfg, level)
        eval_path = _materialize_spec(cfg, level_spec(spec, plan.target_level, spec.eval_size))[1]
    columns = {"path": str(train_path), "prompt_key": "prompt", "label_key": "label", "data_source_key": "data_source"}
    data = cfg.data.model_copy(update=columns)
    update: dict[str, Any] = {"data": data}
    if eval_path is not None:
        update["eval"] = cfg.eval.model_copy(update={"data_path": str(eval_path)})
    return cfg.model_copy(update=update)
