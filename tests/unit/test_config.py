"""The typed config: YAML + --set overrides, validation errors that name field, value and what is allowed."""
import pytest

from ppoflow.config import ConfigError, PPOFlowConfig, apply_overrides, load_config


def test_defaults_follow_openrlhf():
    cfg = PPOFlowConfig()
    assert (cfg.algo.gamma, cfg.algo.lam, cfg.algo.value_clip, cfg.reward.clip, cfg.algo.kl_estimator) == \
        (1.0, 1.0, 0.5, 10.0, "k1")


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: r1, iterations: 3}\nalgo: {name: grpo}\nrollout: {n_samples: 4}\n")
    cfg = load_config(path, ["algo.kl_coef=0.05", "rollout.stop_token_ids=[5, 6]", "model.critic_path=null"])
    assert cfg.run.name == "r1" and cfg.run.iterations == 3 and cfg.algo.name == "grpo"
    assert cfg.algo.kl_coef == 0.05 and cfg.rollout.stop_token_ids == [5, 6] and cfg.model.critic_path is None
    assert cfg.rollout_batch_size == cfg.rollout.prompts_per_iteration * 4


@pytest.mark.parametrize("override, field, value", [
    ("algo.name=ppo2", "algo.name", "ppo2"),
    ("rollout.temperature=0", "rollout.temperature", "0"),
    ("train.zero_stage=4", "train.zero_stage", "4"),
    ("run.name=a/b", "run.name", "a/b"),
])
def test_error_names_field_and_value(override, field, value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value) and value in str(err.value)


def test_unknown_key_is_an_error_not_a_silent_default():
    with pytest.raises(ConfigError, match="algo.kl_coeff"):
        load_config(None, ["algo.kl_coeff=0.1"])


def test_group_algorithms_need_groups():
    with pytest.raises(ConfigError, match="n_samples"):
        load_config(None, ["algo.name=grpo", "rollout.n_samples=1"])


def test_train_batch_must_divide_rollout_batch():
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config(None, ["rollout.prompts_per_iteration=8", "rollout.n_samples=2", "train.train_batch_size=5"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.field=value"):
        apply_overrides({}, ["algo.kl_coef"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_section_hash_tracks_only_its_sections():
    a, b = PPOFlowConfig(), load_config(None, ["train.actor_lr=0.5"])
    assert a.section_hash("rollout") == b.section_hash("rollout")
    assert a.section_hash("train") != b.section_hash("train")
