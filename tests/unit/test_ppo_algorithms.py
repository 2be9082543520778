"""The algorithm registry and the config checks that read it."""

import subprocess
import sys
import typing

import pytest

from ppoflow.algorithms import AGG_MODES, ALGO_NAMES, ALGORITHMS, GROUP_ALGOS, get_algorithm, resolve_loss_agg
from ppoflow.config import AlgoConfig, ConfigError, load_config


def test_the_config_allows_exactly_the_registry_names():
    allowed = typing.get_args(AlgoConfig.model_fields["name"].annotation)
    assert allowed == ALGO_NAMES == ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def test_registry_entries():
    # written out from the papers (see the module docstring), not read back from the table
    assert [a for a in ALGO_NAMES if ALGORITHMS[a].uses_critic] == ["ppo"]
    assert GROUP_ALGOS == ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
    assert {a: ALGORITHMS[a].default_loss_agg for a in ALGO_NAMES} == {
        "ppo": "token_mean",
        "grpo": "token_mean",
        "dr_grpo": "seq_mean_token_sum_norm",
        "rloo": "token_mean",
        "reinforce_pp": "token_mean",
        "reinforce_pp_baseline": "token_mean",
    }
    with pytest.raises(ValueError, match="algo.name='a2c' is not a known algorithm"):
        get_algorithm("a2c")
    with pytest.raises(ValueError, match="algo.loss_agg='sum'"):
        resolve_loss_agg("ppo", "sum")
    assert resolve_loss_agg("dr_grpo", "token_mean") == "token_mean"
    assert set(AGG_MODES) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"}


def test_config_module_does_not_import_torch():
    code = "import sys, ppoflow.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("algo", GROUP_ALGOS)
def test_group_algorithms_refuse_discounting(algo):
    with pytest.raises(ConfigError, match=rf"algo.gamma=0.99 with algo.name='{algo}'"):
        load_config(None, [f"algo.name={algo}", "algo.gamma=0.99"])
    with pytest.raises(ConfigError, match=rf"algo.name='{algo}' needs rollout.n_samples >= 2"):
        load_config(None, [f"algo.name={algo}", "rollout.n_samples=1"])


@pytest.mark.parametrize("algo", ["ppo", "reinforce_pp"])
def test_other_algorithms_accept_discounting_and_single_samples(algo):
    cfg = load_config(None, [f"algo.name={algo}", "algo.gamma=0.99", "rollout.n_samples=1"])
    assert cfg.algo.gamma == 0.99


def test_loss_agg_defaults_and_norm():
    assert load_config(None, []).algo.resolved_loss_agg == "token_mean"
    cfg = load_config(None, ["algo.name=dr_grpo", "rollout.max_new_tokens=24"])
    assert (cfg.algo.resolved_loss_agg, cfg.loss_agg_norm) == ("seq_mean_token_sum_norm", 24.0)
    cfg = load_config(None, ["algo.name=grpo", "algo.loss_agg=seq_mean_token_sum_norm", "algo.loss_agg_norm=100"])
    assert cfg.loss_agg_norm == 100.0
    with pytest.raises(ConfigError, match="algo.loss_agg_norm=100.0 is only used by"):
        load_config(None, ["algo.name=grpo", "algo.loss_agg_norm=100"])


def test_k1_in_the_loss_is_refused_while_the_kl_is_on():
    # k1 = log pi - log pi_ref has gradient grad log pi, and E_pi[grad log pi] = sum_y grad pi(y) = grad 1 = 0
    refusal = r"algo.kl_estimator='k1' with algo.kl_in_reward=false.*use algo.kl_estimator=k3.*or k2"
    grpo_kl_in_loss = ["algo.name=grpo", "algo.kl_in_reward=false"]
    with pytest.raises(ConfigError, match=refusal):
        load_config(None, grpo_kl_in_loss)  # kl_estimator defaults to k1, kl_coef to 0.01
    with pytest.raises(ConfigError, match=refusal):
        load_config(None, [*grpo_kl_in_loss, "algo.kl_coef=0", "algo.kl_target=0.1"])  # adaptive: the KL is on
    for estimator in ("k2", "k3"):
        assert load_config(None, [*grpo_kl_in_loss, f"algo.kl_estimator={estimator}"]).algo.kl_estimator == estimator
    assert load_config(None, [*grpo_kl_in_loss, "algo.kl_coef=0"]).algo.kl_coef == 0.0  # no KL term at all
    assert load_config(None, ["algo.name=grpo", "algo.kl_in_reward=true"]).algo.kl_estimator == "k1"  # k1 in reward


def test_removed_and_bounded_fields_name_themselves():
    with pytest.raises(ConfigError, match="algo.vf_coef was removed"):
        load_config(None, ["algo.vf_coef=0.5"])
    with pytest.raises(ConfigError, match="algo.tis_cap"):
        load_config(None, ["algo.tis_cap=0.5"])
    with pytest.raises(ConfigError, match=r"reward.overlong.buffer=20 must be <= rollout.max_new_tokens=16"):
        load_config(None, ["reward.overlong={buffer: 20}"])
    cfg = load_config(None, ["reward.overlong={buffer: 4, penalty: 0.5}", "reward.normalize=running"])
    assert (cfg.reward.overlong.buffer, cfg.reward.overlong.penalty, cfg.reward.normalize) == (4, 0.5, "running")
