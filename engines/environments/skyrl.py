"""SkyRL-Gym's environments (skyrl-gym 0.4.0, PyPI) behind ppoflow's Environment contract, unchanged.

SkyRL-Gym's text environments already speak in the contract's terms: `init(prompt_messages)` -> (messages,
metadata), `step(action_text)` -> {observations: [messages], reward, done, metadata}, `close()`. The adapter
makes one per sample with `skyrl_gym.make(env_class, env_config=..., extras=row)`, as SkyRL's own trainer
does, so a SkyRL dataset row (prompt, env_class, reward_spec, extra_info, the environment's own fields such
as db_id) works as it is. Offline environments in 0.4.0: gsm8k, gsm8k_multi_turn, aime, text2sql (a SQL tool
over local sqlite files), lcb (runs code against tests); search and searchcode call a search server.

Naming one in the config (`rollout.environment.source`):
- `engines.environments.skyrl:SkyRLGymEnvironment`: each row names its environment in `env_class`;
- a file of your own for a fixed environment or one that needs `env_config` (SkyRL's per-environment
  settings, passed as an omegaconf DictConfig as SkyRL does):

      # my_envs.py        source: my_envs.py:text2sql
      from engines.environments.skyrl import SkyRLGymEnvironment
      text2sql = SkyRLGymEnvironment.using("text2sql", db_path="/data/sql")

Mapping: the row's text prompt becomes [{"role": "user", "content": prompt}]; a row without `reward_spec`
gets {"method": "rule", "ground_truth": row["label"]}, and `extra_info` defaults to {}. Each step hands the
environment the newest assistant message; its observation messages (one role, "user" or "tool") become the
Observation's text, joined by newlines; its per-turn rewards add up to the sample's reward (the contract's
sum); its metadata (made JSON-able) is the info. What cannot be carried is an error, never a silent change:
an `init` that returns more than one message (a system prompt, say: the contract's first turn is one user
message) or observations of another role. SkyRL's `postprocessed_action` (an edited action for the chat
history) is recorded in info["postprocessed_action"] but not applied: ppoflow trains on the tokens the policy
sampled, so the history keeps them.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from engines.environments.base import Message, Observation


class SkyRLGymEnvironment:
    """One SkyRL-Gym environment per sample; see the module docstring. Built with no arguments by ppoflow."""

    identity_packages = ("skyrl-gym",)  # its environments' code lives in the library: its version keys the cache
    env_class: Optional[str] = None  # when the row has no env_class
    env_config: Mapping[str, Any] = {}

    @classmethod
    def using(cls, env_class: str, **env_config: Any) -> type["SkyRLGymEnvironment"]:
        """A factory (a subclass) for one environment id and its env_config, for a user's factory file."""
        return type(f"SkyRL_{env_class}", (cls,), {"env_class": env_class, "env_config": dict(env_config)})

    def __init__(self):
        self.env = None

    def reset(self, row: Mapping[str, Any]) -> Optional[str]:
        import skyrl_gym
        from omegaconf import OmegaConf

        env_class = row.get("env_class") or self.env_class
        if not env_class:
            raise ValueError(
                "the row has no 'env_class' and the factory names none: add the column, or use "
                "SkyRLGymEnvironment.using('<env id>') (ids: " + ", ".join(sorted(skyrl_gym.registry)) + ")"
            )
        extras = dict(row)
        if "reward_spec" not in extras:
            extras["reward_spec"] = {"method": "rule", "ground_truth": row.get("label")}
        extras.setdefault("extra_info", {})
        self.env = skyrl_gym.make(env_class, env_config=OmegaConf.create(dict(self.env_config)), extras=extras)
        prompt = row["prompt"]
        chat = list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}]
        conversation, _metadata = self.env.init(chat)
        if list(conversation) == chat:
            return None
        if len(conversation) == 1 and conversation[0].get("role") == "user":
            return conversation[0]["content"]
        roles = [m.get("role") for m in conversation]
        raise ValueError(
            f"{env_class}.init returned {len(conversation)} messages (roles {roles}): ppoflow's first turn is one "
            f"user message (engines/environments/base.py)"
        )

    def step(self, messages: list[Message]) -> Observation:
        out = self.env.step(messages[-1]["content"])
        observations = list(out.get("observations") or [])
        roles = sorted({m["role"] for m in observations}) or ["user"]
        if len(roles) > 1 or roles[0] not in ("user", "tool"):
            raise ValueError(f"step returned observation messages of roles {roles}: expected one of 'user', 'tool'")
        info = _jsonable(dict(out.get("metadata") or {}))
        if out.get("postprocessed_action") is not None:
            info["postprocessed_action"] = out["postprocessed_action"]
        return Observation(
            text="\n".join(str(m["content"]) for m in observations),
            role=roles[0],
            reward=float(out["reward"]),
            done=bool(out["done"]),
            info=info,
        )

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def _jsonable(value: dict) -> dict:
    """`value` with whatever JSON cannot hold (sets, frames, numpy scalars) as its str()."""
    return json.loads(json.dumps(value, default=str))
