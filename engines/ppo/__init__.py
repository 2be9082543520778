"""PPO math as pure torch functions: log-probs, KL, token rewards, advantages, losses, KL controllers.

No module state, no Prefect, no distributed calls: the trainer (engines/trainer) calls these by name.
Every function documents its tensor shapes and mask polarity (1 = response token / counts).

The names below are imported lazily (PEP 562 `__getattr__`), so that naming one does not import torch for all.
The algorithm registry's names are re-exported from ppoflow/algorithms.py (the config's floor: it validates
`algo.name` and must import nothing from engines).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ppoflow.algorithms": (
        "AGG_MODES",
        "ALGORITHMS",
        "ALGO_NAMES",
        "GROUP_ALGOS",
        "Algorithm",
        "get_algorithm",
        "resolve_loss_agg",
    ),
    "engines.ppo.advantages": (
        "ALGOS",
        "GROUP_ESTIMATORS",
        "AdvantageReturns",
        "compute_advantages",
        "discounted_returns",
        "gae",
        "group_advantages",
        "kl_token_rewards",
        "masked_whiten",
    ),
    "engines.ppo.kl": ("KL_ESTIMATORS", "kl_penalty"),
    "engines.ppo.kl_controller": (
        "AdaptiveKLController",
        "FixedKLController",
        "KLController",
        "kl_controller_from_state",
        "make_kl_controller",
    ),
    "engines.ppo.logprobs": ("entropy_from_logits", "selective_log_softmax", "selective_log_softmax_and_entropy"),
    "engines.ppo.losses": (
        "PolicyLossOutput",
        "ValueLossOutput",
        "aggregate",
        "entropy_loss",
        "kl_loss",
        "policy_loss",
        "truncated_is_weights",
        "value_loss",
    ),
    "engines.ppo.masked": ("masked_mean", "masked_sum", "masked_var"),
    "engines.ppo.rewards": ("clip_scores", "last_response_index", "overlong_penalty", "token_level_rewards"),
    "engines.ppo.reward_norm": ("RunningMoments",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'engines.ppo' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
