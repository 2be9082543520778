"""PPO math as pure torch functions: log-probs, KL, token rewards, advantages, losses, KL controllers.

No module state, no Prefect, no distributed calls: the trainer (engines/trainer) calls these by name.
Every function documents its tensor shapes and mask polarity (1 = response token / counts).
"""
from engines.ppo.advantages import (ALGOS, GROUP_ESTIMATORS, AdvantageReturns, compute_advantages,
                                    discounted_returns, gae, group_advantages, kl_token_rewards,
                                    masked_whiten)
from engines.ppo.kl import KL_ESTIMATORS, kl_penalty
from engines.ppo.kl_controller import (AdaptiveKLController, FixedKLController, KLController,
                                       kl_controller_from_state, make_kl_controller)
from engines.ppo.logprobs import entropy_from_logits, selective_log_softmax
from engines.ppo.losses import (AGG_MODES, PolicyLossOutput, ValueLossOutput, aggregate, entropy_loss,
                                kl_loss, policy_loss, value_loss)
from engines.ppo.masked import masked_mean, masked_sum, masked_var
from engines.ppo.rewards import clip_scores, last_response_index, token_level_rewards

__all__ = [
    "ALGOS", "AGG_MODES", "GROUP_ESTIMATORS", "KL_ESTIMATORS",
    "AdaptiveKLController", "AdvantageReturns", "FixedKLController", "KLController", "PolicyLossOutput",
    "ValueLossOutput", "aggregate", "clip_scores", "compute_advantages", "discounted_returns",
    "entropy_from_logits", "entropy_loss", "gae", "group_advantages", "kl_controller_from_state",
    "kl_loss", "kl_penalty", "kl_token_rewards", "last_response_index", "make_kl_controller",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten", "policy_loss", "selective_log_softmax",
    "token_level_rewards", "value_loss",
]
