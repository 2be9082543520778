"""The Prefect cache key of a stage task: run / iteration / stage / hash(inputs' identities, config sections).

A retried flow run recomputes the same keys, finds the persisted results of the stages that completed,
and resumes at the first stage without one. A changed input or setting changes the key, so a stale result
is never reused. An input hand-off (stages/manifests.py) counts by its `identity()` (a content
hash), a list of them item by item, any other parameter by its JSON form. The key also holds the run's
identity (`<run>/run.json`: run id and results epoch), read at each key: `ppoflow runs repair` disowns every
result persisted before it by moving the epoch on, wherever those results are.
"""

from __future__ import annotations

from typing import Any

from ppoflow.config import PPOFlowConfig, as_config
from ppoflow.fingerprint import json_hash
from stages.manifests import HandOff
from storage.layout import layout_for
from storage.run_identity import results_identity

# The config sections each stage's output depends on (besides its input hand-offs).
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "rollout": ("model", "data", "rollout"),
    # pipeline.rollout_parts > 1: a part is keyed by its index and count too (its parameters); the merge by the
    # parts' content hashes. pipeline.* is in no key: how a stage is spread over processes changes no row.
    "rollout-part": ("model", "data", "rollout"),
    "rollout-merge": ("model", "data", "rollout"),
    "score": ("model", "reward", "score", "rollout"),
    "update": ("model", "algo", "train", "reward"),
    "checkpoint": ("run",),
    # eval: the committed policy (its PolicyRef input), the held-out set and its sampling, the reward
    "eval": ("model", "data", "rollout", "reward", "eval"),
    # Reward-model training (tasks/rm_train.py; "iteration" is the unit). The prepare's key also holds the contents
    # of the pair files and the backbone (below), which its RMPlan's identity carries on into every unit's key.
    "rm-prepare": ("model", "rm_train"),
    "rm-unit": ("model", "train", "rm_train"),
    "rm-export": ("model", "train", "rm_train"),
}


# The stages that run the policy against rollout.environment (eval plays the held-out rows through it too).
ROLLOUT_STAGES = ("rollout", "rollout-part", "eval")


def stage_sections(cfg: PPOFlowConfig, stage: str) -> tuple[str, ...]:
    """STAGE_SECTIONS, plus "reward" for a rollout with dynamic sampling (which groups it keeps is the reward's), and
    "data" for an update with a curriculum (the promotion rule is data.reasoning_gym.curriculum's)."""
    sections = STAGE_SECTIONS[stage]
    if stage == "rollout" and cfg.rollout.dynamic_sampling.enabled:
        sections += ("reward",)
    spec = cfg.data.reasoning_gym
    if stage == "update" and spec is not None and spec.curriculum is not None:
        sections += ("data",)  # the update commits the next curriculum level (stages/curriculum_state.py)
    return sections


def stage_cache_key(cfg: PPOFlowConfig, stage: str, iteration: int, inputs: dict[str, Any]) -> str:
    """The key under which a stage's result is persisted; see the module docstring."""
    identities = {k: _identity(v) for k, v in inputs.items()}
    # The run's identity (its run id and results epoch, storage/run_identity.py), not its storage root: two runs
    # of one name (two roots, or one deleted and started again) never share a result, on any worker, while a
    # run moved to another root or bucket finds its completed stages again (its run.json moves with it).
    config_hash = cfg.section_hash(*stage_sections(cfg, stage))
    run = results_identity(layout_for(cfg))
    payload = {"inputs": identities, "config": config_hash, "seed": cfg.run.seed, "run": run}
    if stage in ROLLOUT_STAGES and cfg.rollout.environment is not None:
        # The environment's code answers the policy inside the rollout (its source spec alone is in the config):
        # an edited environment is a new key. Only when set, so single-turn keys are what they were.
        from stages.rollout_env import environment_identity

        payload["environment"] = environment_identity(cfg)
    if "reward" in stage_sections(cfg, stage) and stage != "update" and (code := reward_code_identity(cfg)):
        # A reward function's code is not in the config (only its spec): an edited reward file is a new key, so a
        # retried or resumed iteration scores with the code it now has. Only when there is a function source.
        payload["reward_code"] = code
    if stage == "rm-prepare":
        # The pairs and the backbone are files the config names by path only: edited pairs are a new key.
        from stages.reward_model import data_identity

        payload["data"] = data_identity(cfg)
    digest = json_hash(payload)
    return f"{cfg.run.name}-iter-{iteration:06d}-{stage}-{digest}"


def reward_code_identity(cfg: PPOFlowConfig) -> dict[str, str]:
    """{spec: sha256 of the file its code lives in} of the run's function reward sources, found without importing
    them (a "path/file.py:fn" spec's file, a "pkg.module:fn" spec's module file); {} when there are none. A spec
    whose file cannot be found is left out: the score stage itself then fails naming it."""
    import hashlib
    import importlib.util
    from pathlib import Path

    from engines.rewards.function import is_file_spec

    code = {}
    for source in cfg.reward.sources:
        if source.kind != "function":
            continue
        where = source.target.rsplit(":", 1)[0]
        origin = where
        if not is_file_spec(where):
            try:
                module = importlib.util.find_spec(where)  # imports its parent packages only, not the module
            except (ImportError, ValueError):
                module = None
            origin = module.origin if module is not None else None
        file = Path(origin).expanduser() if origin else None
        if file is not None and file.is_file():
            code[source.target] = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    return code


def _identity(value: Any) -> Any:
    """A hand-off's identity, a list's item by item (the merge's rollout parts), anything else as it is."""
    if isinstance(value, HandOff):
        return value.identity()
    return [_identity(v) for v in value] if isinstance(value, (list, tuple)) else value


def cache_key_fn(stage: str):
    """A Prefect cache_key_fn for a stage task whose parameters are (config, iteration, **input hand-offs)."""

    def _key(_context, parameters: dict[str, Any]) -> str:
        inputs = {k: v for k, v in parameters.items() if k not in ("config", "iteration")}
        return stage_cache_key(as_config(parameters["config"]), stage, int(parameters["iteration"]), inputs)

    return _key
