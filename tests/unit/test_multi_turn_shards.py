"""Multi-turn rows in the shards (storage/schema.py version 2), the environment's reward through the scorer, the
config section and the rollout's cache key.

Rows are built here from two hand-made conversations (no model): what the driver returns is tested in
test_multi_turn_rollout.py.
"""

import pyarrow as pa
import pyarrow.ipc
import pytest

from engines.data import PromptRecord
from engines.rollout.base import RolloutSample
from engines.rollout.multi_turn import ConversationSample
from engines.scoring.cached import score_with_cache
from engines.scoring.scorer import Scorer
from engines.toy.model import build_tokenizer
from ppoflow.config import PPOFlowConfig
from stages.tables import experience_batch, rollout_table, scored_table, scoring_inputs
from storage import shards
from storage.schema import MULTI_TURN_COLUMNS, SchemaMismatchError

RECORDS = [PromptRecord(index=4, text="user : say 7 : assistant : ", prompt_ids=[1, 2, 3], label="7", data_source="d")]


def _conversations() -> list[ConversationSample]:
    common = dict(prompt_index=0, prompt_ids=[25, 28, 11, 20, 26, 20], policy_version=3)
    two_turns = ConversationSample(
        sample_index=0,
        response_ids=[9, 8, 25, 20, 11, 26, 20, 11, 2],  # "5 4 | user : 7 assistant : | 7 </s>"
        rollout_logprobs=[-1.0, -2.0, 0, 0, 0, 0, 0, -0.5, -0.25],
        finish_reason="stop",
        token_owner=[1, 1, 0, 0, 0, 0, 0, 1, 1],
        turn_starts=[0, 2, 7],
        env_reward=0.9,
        turns=2,
        prompt_text="user : say 7 : assistant : ",
        env_info=[{"step": 1}, {"step": 2, "tool_error": None}],
        **common,
    )
    cut = ConversationSample(
        sample_index=1,
        response_ids=[12, 12],
        rollout_logprobs=[-0.1, -0.2],
        finish_reason="length",
        token_owner=[1, 1],
        turn_starts=[0],
        env_reward=-0.1,
        turns=1,
        truncation="max_turns",
        prompt_text="user : say 7 : assistant : ",
        **common,
    )
    return [two_turns, cut]


def test_rollout_rows_round_trip_as_version_2_shards_pyarrow_reads(tmp_path):
    import fsspec

    table = rollout_table(RECORDS, _conversations(), build_tokenizer(), iteration=3)
    assert table.schema.field("token_owner").type == pa.list_(pa.int8())
    fs = fsspec.filesystem("file")
    manifest = shards.write_shards(fs, str(tmp_path / "rollout"), table, "rollout")
    assert manifest.schema_version == 2
    part = tmp_path / "rollout" / manifest.parts[0].name
    read = pyarrow.ipc.open_file(str(part)).read_all()  # a person with pyarrow alone
    assert read.schema.metadata[b"ppoflow.schema_version"] == b"2"
    assert read.column("token_owner").to_pylist() == [[1, 1, 0, 0, 0, 0, 0, 1, 1], [1, 1]]
    assert read.column("turn_starts").to_pylist() == [[0, 2, 7], [0]]
    assert read.column("truncation").to_pylist() == [None, "max_turns"]
    assert read.column("env_reward").to_pylist() == pytest.approx([0.9, -0.1])
    assert read.column("env_info").to_pylist() == ['[{"step": 1}, {"step": 2, "tool_error": null}]', "[]"]
    assert shards.read_shards(fs, str(tmp_path / "rollout")).equals(table)
    # a table with only some of the multi-turn columns is refused naming the one missing
    with pytest.raises(SchemaMismatchError, match="'turns' is missing"):
        shards.write_shards(fs, str(tmp_path / "bad"), table.drop(["turns"]), "rollout")


def test_single_turn_rows_stay_version_1(tmp_path):
    import fsspec

    sample = RolloutSample(0, 0, [1, 2, 3], [4, 2], [-1.0, -0.5], "stop")
    table = rollout_table(RECORDS, [sample], build_tokenizer(), iteration=1)
    assert not set(MULTI_TURN_COLUMNS) & set(table.column_names)
    manifest = shards.write_shards(fsspec.filesystem("file"), str(tmp_path / "r"), table, "rollout")
    assert manifest.schema_version == 1
    with pytest.raises(SchemaMismatchError, match=r"columns \['token_owner'\] are in multi-turn shards only"):
        shards.read_shards(fsspec.filesystem("file"), str(tmp_path / "r"), columns=["prompt", "token_owner"])


def test_environment_reward_reaches_the_score_and_the_policy_mask_the_batch(tiny_model_dir):
    # reward = 1.0 * env_reward + 0.5 * digit share of the response, clipped at 10 (the scorer's formula)
    cfg = _config(
        tiny_model_dir,
        sources=[
            {"kind": "environment"},
            {"kind": "function", "target": "engines.toy.task:reward_func", "weight": 0.5},
        ],
    )
    table = rollout_table(RECORDS, _conversations(), build_tokenizer(), iteration=3)
    inputs = scoring_inputs(table)
    assert [x.env_reward for x in inputs] == pytest.approx([0.9, -0.1])
    scorer = Scorer(cfg)
    results, _ = score_with_cache(scorer, inputs, None)
    # response texts: "5 4 user : 7 assistant : 7" (2 sevens of 8 words) and "8 8" (none of TARGET_LENGTH 8)
    assert [r.components["environment"] for r in results] == pytest.approx([0.9, -0.1])
    assert [r.reward for r in results] == pytest.approx([0.9 + 0.5 * 2 / 8, -0.1])
    scored = scored_table(table, results, [False, False])
    batch = experience_batch(scored, pad_token_id=0)
    assert batch.policy_mask.tolist() == [[1, 1, 0, 0, 0, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0, 0]]
    # env_reward is in the cache key: the same tokens with another environment reward are another entry
    keyed = [x.__class__(**{**x.__dict__, "env_reward": 5.0}) for x in inputs]
    assert score_with_cache(scorer, keyed, _DictCache(score_with_cache, scorer, inputs))[1].hits == 0


class _DictCache(dict):
    """A score cache in a dict (ScoreCacheLike), filled with `inputs` scored once."""

    def __init__(self, score, scorer, inputs):
        super().__init__()
        score(scorer, inputs, self)

    def get_many(self, keys):
        return {k: self[k] for k in keys if k in self}

    def put_many(self, entries):
        self.update(entries)


def _config(model_dir, sources=({"kind": "environment"},), **env) -> PPOFlowConfig:
    return PPOFlowConfig.model_validate(
        {
            "model": {"policy_path": str(model_dir), "apply_chat_template": True},
            "rollout": {"environment": {"source": "tests.fixtures.digit_env:DigitGuessEnv", **env}},
            "reward": {"sources": list(sources)},
        }
    )


def test_config_refuses_bad_values_naming_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="rollout.environment.max_turns"):
        _config(tiny_model_dir, max_turns=0)
    with pytest.raises(ValueError, match="rollout.environment.source"):
        _config(tiny_model_dir, source="no_colon_here")
    with pytest.raises(ValueError, match=r"reward.sources.0.kind='environment' needs rollout.environment"):
        PPOFlowConfig.model_validate({"reward": {"sources": [{"kind": "environment"}]}})
    with pytest.raises(ValueError, match="model.apply_chat_template=true"):
        PPOFlowConfig.model_validate({"rollout": {"environment": {"source": "tests.fixtures.digit_env:DigitGuessEnv"}}})


def test_single_turn_config_dumps_as_before_and_the_environment_code_is_in_the_rollout_key(tiny_model_dir, tmp_path):
    from tasks.cache_keys import stage_cache_key

    plain = PPOFlowConfig()
    assert "environment" not in plain.model_dump(mode="json")["rollout"]  # config.yaml, hashes, keys unchanged
    env_file = tmp_path / "my_env.py"
    env_file.write_text("from engines.environments.base import Observation\n\nclass Env:\n    pass\n")
    cfg = _config(tiny_model_dir, source=f"{env_file}:Env").model_copy(
        update={"run": plain.run.model_copy(update={"root": str(tmp_path)})}
    )
    before = {stage: stage_cache_key(cfg, stage, 1, {}) for stage in ("rollout", "eval")}
    assert {stage: stage_cache_key(cfg, stage, 1, {}) for stage in ("rollout", "eval")} == before
    env_file.write_text(env_file.read_text() + "# an edit to the environment's code, same spec\n")
    # the eval stage plays the held-out rows through the same environment: its key follows the code too
    for stage in ("rollout", "eval"):
        assert stage_cache_key(cfg, stage, 1, {}) != before[stage], stage


def test_preflight_names_an_environment_that_cannot_be_imported():
    from flows.preflight_static import environment_problem

    assert environment_problem("tests.fixtures.digit_env:DigitGuessEnv") is None
    problem = environment_problem("tests.fixtures.digit_env:NoSuchEnv")
    assert problem.startswith("rollout.environment.source: ") and "NoSuchEnv" in problem
