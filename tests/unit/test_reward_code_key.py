"""A reward function's code is part of the score stage's cache key (tasks/cache_keys.py): a retried or resumed
iteration after an edit of the reward file must score again, not reuse the cached stage. Properties: an edit of
any line of the file (a helper, not the function) changes the key; no edit, or a model-only reward, keeps it;
the update stage, which reads the scored rows, keeps its key."""

from __future__ import annotations

from ppoflow.config import PPOFlowConfig
from tasks.cache_keys import reward_code_identity, stage_cache_key

REWARD = """
def _bonus(text):
    return {bonus}

def reward_func(queries, prompts, labels, **kwargs):
    return [_bonus(q) for q in queries]
"""


def _config(tmp_path, target: str) -> PPOFlowConfig:
    return PPOFlowConfig.model_validate(
        {
            "run": {"name": "r", "root": str(tmp_path / "runs")},
            "reward": {"sources": [{"kind": "function", "target": target}]},
        }
    )


def _score_key(cfg) -> str:
    return stage_cache_key(cfg, "score", 1, {"rollout": "rollout-content-hash"})  # a hand-off's identity stand-in


def test_an_edit_of_a_helper_in_the_reward_file_is_a_new_score_key(tmp_path):
    file = tmp_path / "reward.py"
    file.write_text(REWARD.format(bonus=1.0))
    cfg = _config(tmp_path, f"{file}:reward_func")
    before = _score_key(cfg)
    assert _score_key(cfg) == before  # nothing edited: the same key (a retry finds the completed stage)
    file.write_text(REWARD.format(bonus=0.5))  # only the helper changed, not reward_func
    assert _score_key(cfg) != before
    file.write_text(REWARD.format(bonus=1.0))
    assert _score_key(cfg) == before  # the key follows the content, not the edit time


def test_a_module_spec_is_keyed_by_its_module_file_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(REWARD.format(bonus=1.0) + "\nraise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _config(tmp_path, "mypkg.scoring:reward_func")
    first = reward_code_identity(cfg)  # would raise had it imported mypkg.scoring
    assert list(first) == ["mypkg.scoring:reward_func"]
    (package / "scoring.py").write_text(REWARD.format(bonus=2.0))
    assert reward_code_identity(cfg) != first


def test_update_keys_and_model_rewards_do_not_carry_reward_code(tmp_path):
    file = tmp_path / "reward.py"
    file.write_text(REWARD.format(bonus=1.0))
    cfg = _config(tmp_path, f"{file}:reward_func")
    scored = "scored-content-hash"
    update_key = stage_cache_key(cfg, "update", 1, {"scored": scored})
    file.write_text(REWARD.format(bonus=0.5))
    assert stage_cache_key(cfg, "update", 1, {"scored": scored}) == update_key  # its input is the scored rows
    model_only = PPOFlowConfig.model_validate(
        {
            "run": {"name": "r", "root": str(tmp_path / "runs")},
            "reward": {"sources": [{"kind": "model", "target": str(tmp_path)}]},
        }
    )
    assert reward_code_identity(model_only) == {}
