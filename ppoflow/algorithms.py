"""The algorithm registry: one entry per `algo.name`, read by the config, the advantages and the trainer.

Torch-free and in the config's package on purpose: ppoflow/config/ validates `algo.name` and `algo.loss_agg`
against these tables before any work starts, and the config imports nothing from engines (engines import it).

| name                  | advantage estimator                          | critic | groups | default loss_agg        |
|-----------------------|----------------------------------------------|--------|--------|-------------------------|
| ppo                   | GAE on token rewards (Schulman et al.)       | yes    | no     | token_mean              |
| grpo                  | (s - mean_g) / std_g (Shao et al. 2024)      | no     | yes    | token_mean              |
| dr_grpo               | s - mean_g (Liu et al. 2025, Dr. GRPO)       | no     | yes    | seq_mean_token_sum_norm |
| rloo                  | s - leave-one-out mean (Ahmadian et al. 2024)| no     | yes    | token_mean              |
| reinforce_pp          | whitened reward-to-go (Hu 2025, REINFORCE++) | no     | no     | token_mean              |
| reinforce_pp_baseline | REINFORCE++, group mean as baseline          | no     | yes    | token_mean              |

Loss aggregation (engines/ppo/losses.aggregate) and which paper uses which:
- token_mean: every response token of the optimizer step weighs the same. DAPO (Yu et al. 2025) argues for
  it (long responses are not down-weighted); OpenRLHF's and veRL's default; ppoflow's default for all but
  dr_grpo, so a config that names no `algo.loss_agg` trains as before.
- seq_mean_token_mean: the mean over responses of each response's token mean: the GRPO paper's
  1/G sum_i 1/|o_i| sum_t (Shao et al. 2024) and PPO as written for RLHF by Ouyang et al.; Dr. GRPO shows it
  favours short correct and long wrong answers.
- seq_mean_token_sum_norm: sum of token losses / (responses * a constant): Dr. GRPO's unbiased form (Liu et
  al. 2025), the constant being the generation budget (`algo.loss_agg_norm`, default rollout.max_new_tokens).
  It is dr_grpo's default here: the group estimator without the std is only half of Dr. GRPO (issue 21).
"""

from __future__ import annotations

from dataclasses import dataclass

AGG_MODES: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# How compute_advantages turns scores / token rewards into advantages (engines/ppo/advantages.py).
ADVANTAGE_KINDS: tuple[str, ...] = ("gae", "group", "reinforce", "reinforce_group_baseline")


@dataclass(frozen=True)
class Algorithm:
    """One `algo.name`.

    advantage: one of ADVANTAGE_KINDS. uses_critic: a value model is trained (GAE needs it).
    needs_groups: rows come in groups of rollout.n_samples >= 2 samples of one prompt, and the estimator
    uses the group (so gamma must be 1: the group baseline is a per-response score, not a per-step value).
    default_loss_agg: the aggregation used when `algo.loss_agg` is None. paper: where it comes from.
    """

    name: str
    advantage: str
    uses_critic: bool
    needs_groups: bool
    default_loss_agg: str
    paper: str


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("ppo", "gae", True, False, "token_mean", "Schulman et al. 2017; Ouyang et al. 2022"),
        Algorithm("grpo", "group", False, True, "token_mean", "Shao et al. 2024 (DeepSeekMath)"),
        Algorithm("dr_grpo", "group", False, True, "seq_mean_token_sum_norm", "Liu et al. 2025 (Dr. GRPO)"),
        Algorithm("rloo", "group", False, True, "token_mean", "Ahmadian et al. 2024 (RLOO)"),
        Algorithm("reinforce_pp", "reinforce", False, False, "token_mean", "Hu 2025 (REINFORCE++)"),
        Algorithm(
            "reinforce_pp_baseline",
            "reinforce_group_baseline",
            False,
            True,
            "token_mean",
            "Hu 2025 (REINFORCE++ with a group baseline)",
        ),
    )
}
ALGO_NAMES: tuple[str, ...] = tuple(ALGORITHMS)
GROUP_ALGOS: tuple[str, ...] = tuple(a.name for a in ALGORITHMS.values() if a.needs_groups)


def get_algorithm(name: str) -> Algorithm:
    """The registry entry for `name`; ValueError naming algo.name and the allowed values otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algo.name={name!r} is not a known algorithm; expected one of {ALGO_NAMES}") from None


def resolve_loss_agg(name: str, loss_agg: str | None) -> str:
    """`algo.loss_agg` if set, else the algorithm's default; ValueError naming algo.loss_agg if unknown."""
    mode = get_algorithm(name).default_loss_agg if loss_agg is None else loss_agg
    if mode not in AGG_MODES:
        raise ValueError(f"algo.loss_agg={mode!r} is not a known aggregation; expected one of {AGG_MODES}")
    return mode
