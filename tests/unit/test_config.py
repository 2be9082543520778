"""The typed config: YAML + --set overrides, validation errors that name field, value and what is allowed."""

import pytest

from ppoflow.config import ConfigError, PPOFlowConfig, apply_overrides, load_config


def test_defaults_follow_openrlhf():
    cfg = PPOFlowConfig()
    assert (cfg.algo.gamma, cfg.algo.lam, cfg.algo.value_clip, cfg.reward.clip, cfg.algo.kl_estimator) == (
        1.0,
        1.0,
        0.5,
        10.0,
        "k1",
    )


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: r1, iterations: 3}\nalgo: {name: grpo}\nrollout: {n_samples: 4}\n")
    cfg = load_config(path, ["algo.kl_coef=0.05", "rollout.stop_token_ids=[5, 6]", "model.critic_path=null"])
    assert cfg.run.name == "r1" and cfg.run.iterations == 3 and cfg.algo.name == "grpo"
    assert cfg.algo.kl_coef == 0.05 and cfg.rollout.stop_token_ids == [5, 6] and cfg.model.critic_path is None
    assert cfg.rollout_batch_size == cfg.rollout.prompts_per_iteration * 4


@pytest.mark.parametrize(
    "override, field, value",
    [
        ("algo.name=ppo2", "algo.name", "ppo2"),
        ("rollout.temperature=0", "rollout.temperature", "0"),
        ("train.zero_stage=4", "train.zero_stage", "4"),
        ("run.name=a/b", "run.name", "a/b"),
    ],
)
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


# Each bad value of issue 19's list (and a few more), with the field the error must name and a word of what
# is allowed. The bounds come from the math: a ratio clip below 1 must stay in [0, 1) or the clipped ratio
# can reach 0 or below; dual clip only bites above 1; a top-k of 0 keeps no token.
BAD_VALUES = [
    ("algo.kl_coef=.nan", "algo.kl_coef", "finite"),
    ("algo.kl_coef=.inf", "algo.kl_coef", "finite"),
    ("algo.entropy_coef=nan", "algo.entropy_coef", "finite"),
    ("train.actor_lr=.inf", "train.actor_lr", "finite"),
    (
        "reward.sources=[{kind: function, target: 'engines.toy.task:reward_func', weight: .nan}]",
        "reward.sources.0.weight",
        "finite",
    ),
    ("reward.clip=.inf", "reward.clip", "finite"),
    ("reward.sources=[]", "reward.sources", "at least 1"),
    ("run.name=..", "run.name", "plain folder name"),
    ("run.name=.", "run.name", "plain folder name"),
    ("run.name=cache", "run.name", "score cache"),
    ("rollout.top_k=-7", "rollout.top_k", "-1"),
    ("rollout.top_k=0", "rollout.top_k", ">= 1"),
    ("rollout.max_model_len=-3", "rollout.max_model_len", "greater than or equal to 1"),
    ("train.max_grad_norm=-1", "train.max_grad_norm", "greater than 0"),
    ("algo.dual_clip=0.5", "algo.dual_clip", "greater than 1"),
    ("algo.clip_low=5", "algo.clip_low", "less than 1"),
    ("algo.clip_high=-0.1", "algo.clip_high", "greater than or equal to 0"),
    ("algo.value_clip=0", "algo.value_clip", "greater than 0"),
    ("algo.kl_target=-1", "algo.kl_target", "greater than 0"),
    ("rollout.stop_token_ids=[-5]", "rollout.stop_token_ids.0", "greater than or equal to 0"),
    ("rollout.n_samples=true", "rollout.n_samples", "valid integer"),
    ("train.ppo_epochs=2.0", "train.ppo_epochs", "valid integer"),
    ("algo.gamma=true", "algo.gamma", "valid number"),
    ("run.seed='3'", "run.seed", "valid integer"),
    ("train.train_batch_size=0", "train.train_batch_size", "greater than or equal to 1"),
    ("train.train_batch_size=-4", "train.train_batch_size", "greater than or equal to 1"),
    ("pipeline.stage_pools={rollut: ppo-rollout/ppo-rollout}", "rollut", "rollout, score, update, checkpoint"),
    ("pipeline.stage_pools={score: ppo-score}", "pipeline.stage_pools", "flow-name/deployment-name"),
    ("reward.sources=[{kind: remote, target: 'localhost:8000'}]", "reward.sources.0", "http://"),
    ("reward.sources=[{kind: function, target: 'engines/toy/task.py'}]", "reward.sources.0", "file.py:fn"),
]


@pytest.mark.parametrize("override, field, allowed", BAD_VALUES, ids=[b[0][:40] for b in BAD_VALUES])
def test_bad_value_names_field_and_what_is_allowed(override, field, allowed):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value) and allowed in str(err.value)


def test_a_bool_for_an_int_says_it_was_a_bool():
    with pytest.raises(ConfigError, match=r"rollout.n_samples = true \(bool\)"):
        load_config(None, ["rollout.n_samples=true"])


def test_yaml_1_1_exponent_text_is_a_float_but_only_for_float_fields(tmp_path):
    # PyYAML reads `1e-5` as the string "1e-5" (YAML 1.1 floats need a dot); users mean the number.
    path = tmp_path / "c.yaml"
    path.write_text("train: {actor_lr: 1e-5, critic_lr: 2e-4}\nrun: {name: 1e5}\n")
    cfg = load_config(path)
    assert (cfg.train.actor_lr, cfg.train.critic_lr, cfg.run.name) == (0.00001, 0.0002, "1e5")
    with pytest.raises(ConfigError, match="train.actor_lr"):
        load_config(None, ["train.actor_lr=fast"])


def test_ints_are_fine_for_float_fields_and_null_for_optionals():
    cfg = load_config(None, ["algo.kl_coef=0", "reward.clip=5", "train.max_grad_norm=null", "algo.value_clip=null"])
    assert cfg.algo.kl_coef == 0.0 and cfg.reward.clip == 5.0
    assert cfg.train.max_grad_norm is None and cfg.algo.value_clip is None


def test_micro_batch_must_tile_the_train_batch():
    # 4 prompts x 4 samples = 16 rows; micro 6 leaves 16 % 6 = 4 rows over; micro 8 tiles it (2 x 8); micro 32 > 16
    # is cut to 16 by the trainer (one micro-batch).
    base = ["rollout.prompts_per_iteration=4", "rollout.n_samples=4"]
    with pytest.raises(ConfigError, match="train.micro_batch_size=6"):
        load_config(None, base + ["train.micro_batch_size=6"])
    load_config(None, base + ["train.micro_batch_size=8"])
    load_config(None, base + ["train.micro_batch_size=32"])


def test_stage_pools_accept_the_four_stages():
    pools = {s: f"ppo-{s}/ppo-{s}" for s in ("rollout", "score", "update", "checkpoint")}
    cfg = load_config(None, [f"pipeline.stage_pools={pools}"])
    assert cfg.pipeline.stage_pools == pools


def test_every_error_of_a_config_is_listed_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.top_k=-7", "algo.dual_clip=0.5"])
    assert "rollout.top_k" in str(err.value) and "algo.dual_clip" in str(err.value)


def _line_of(text: str, line: str) -> int:
    """1-based number of the line of `text` equal to `line`."""
    return text.splitlines().index(line) + 1


@pytest.mark.parametrize(
    "text, key, section, first, second",
    [
        (
            "run: {name: r1}\nalgo:\n  name: ppo\n  kl_coef: 0.1\n  kl_coef: 0.5\n",
            "kl_coef",
            "in 'algo'",
            "  kl_coef: 0.1",
            "  kl_coef: 0.5",
        ),
        (
            "algo: {name: ppo}\nrun: {name: r1}\nalgo: {name: grpo}\n",
            "algo",
            "at the top level",
            "algo: {name: ppo}",
            "algo: {name: grpo}",
        ),
        (
            "reward:\n  sources:\n  - kind: function\n    target: a.py:f\n    weight: 1\n    weight: 2\n",
            "weight",
            "in 'reward.sources.0'",
            "    weight: 1",
            "    weight: 2",
        ),
    ],
    ids=["in-a-section", "at-the-top", "in-a-list-item"],
)
def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path, text, key, section, first, second):
    # PyYAML keeps the last value without a word: before, the first of each pair was silently dropped.
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"config file {path} line {_line_of(text, second)}: key {key!r} is given twice {section} "
        f"(first on line {_line_of(text, first)}); YAML would keep only the last value: remove one"
    )


def test_a_merge_key_is_not_a_duplicate_and_an_override_is_checked_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  <<: {name: ppo, kl_coef: 0.1}\n  kl_coef: 0.5\n")  # YAML's merge: the key beside it wins
    assert load_config(path).algo.kl_coef == 0.5
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward.sources=[{kind: model, target: m, kind: model}]"])
    assert str(err.value) == (
        "override 'reward.sources=[{kind: model, target: m, kind: model}]': key 'kind' is given twice in "
        "'reward.sources.0'; YAML would keep only the last value: remove one"
    )


def test_two_reward_sources_with_one_name_are_refused_with_the_config_and_before_a_fork_is_made(tmp_path):
    # Two unnamed function sources are both named 'function' (a source is named by its kind): their scores would
    # overwrite each other. Refused when the config is built, naming both entries; a fork asked for with them is
    # refused before anything is written (fork_config builds the config before fork_run touches storage).
    from flows.fork import fork_config

    two = "reward.sources=[{kind: function, target: 'a.py:f'}, {kind: function, target: 'b.py:g'}]"
    with pytest.raises(ConfigError, match=r"'function' at sources 0, 1.*distinct `name`"):
        load_config(None, [two])
    named = two.replace("'a.py:f'}", "'a.py:f', name: len}")
    assert [s.name for s in load_config(None, [named]).reward.sources] == ["len", None]
    with pytest.raises(ConfigError, match=r"'len' at sources 0, 2"):
        load_config(None, [named.replace("]", ", {kind: function, target: 'c.py:h', name: len}]")])
    parent = load_config(None, [f"run.root={tmp_path}", "run.name=parent"])
    with pytest.raises(ConfigError, match=r"'function' at sources 0, 1"):
        fork_config(parent, "child", [two])
    assert list(tmp_path.iterdir()) == []
