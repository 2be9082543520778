"""FunctionRewardSource: both contracts, async, batching, identity, and every error naming its sample."""

import inspect
import textwrap

import pytest

from engines.rewards.base import RewardBatch, RewardError
from engines.rewards.function import FunctionRewardSource, detect_contract, load_reward_function

REWARD_FILE = textwrap.dedent("""
    import asyncio, time
    CALLS = []

    def openrlhf(queries, prompts, labels, **kwargs):
        CALLS.append(len(queries))
        return {"rewards": [float(len(q) - len(p)) for q, p in zip(queries, prompts)]}

    def openrlhf_list(queries, prompts, labels, **kwargs):
        return [1.0 if l == "x" else 0.0 for l in labels]

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 2.0} if solution_str == ground_truth else 0.5

    async def verl_async(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return 3.0

    def short(queries, prompts, labels, **kwargs):
        return {"rewards": [0.0]}

    def nan(queries, prompts, labels, **kwargs):
        return {"rewards": [0.0, float("nan")]}

    def boom(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "bad":
            raise ZeroDivisionError("user bug")
        return 1.0

    def slow(queries, prompts, labels, **kwargs):
        time.sleep(2)
        return [0.0] * len(queries)

    def unknown(a, b):
        return 0.0

    NOT_A_FUNCTION = 3
""")


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return path


def _batch(responses, labels=None):
    n = len(responses)
    return RewardBatch(
        prompts=["p:"] * n,
        responses=list(responses),
        prompt_ids=[[1]] * n,
        response_ids=[[2]] * n,
        labels=labels or [None] * n,
        data_sources=["d"] * n,
        sample_ids=[f"iter 0 prompt 0 sample {i}" for i in range(n)],
    )


def test_openrlhf_contract_batched(reward_file):
    source = FunctionRewardSource(f"{reward_file}:openrlhf", batch_size=2)
    # reward = len(response) because queries = prompt + response: "a"->1, "bb"->2, "ccc"->3.
    assert source.score(_batch(["a", "bb", "ccc"])) == [1.0, 2.0, 3.0]
    assert source.contract == "openrlhf"
    module_calls = source.fn.__globals__["CALLS"]
    assert module_calls == [2, 1]  # batch_size 2 -> calls of 2 then 1 sample


def test_openrlhf_plain_list_and_verl_contracts(reward_file):
    assert FunctionRewardSource(f"{reward_file}:openrlhf_list").score(_batch(["a", "b"], ["x", "y"])) == [1.0, 0.0]
    verl = FunctionRewardSource(f"{reward_file}:verl")
    assert verl.contract == "verl"
    # dict {"score": 2.0} when the response equals the label, a bare float 0.5 otherwise.
    assert verl.score(_batch(["7", "8"], ["7", "7"])) == [2.0, 0.5]


def test_async_function_is_awaited(reward_file):
    assert FunctionRewardSource(f"{reward_file}:verl_async").score(_batch(["a", "b"])) == [3.0, 3.0]


def test_module_spec_and_toy_task_both_contracts():
    batch = _batch(["3 3 3 3 3 3 3 3", "3 1"], ["3", "3"])
    # digits: hits / max(words, 8): 8/8 = 1 and 1/8 = 0.125.
    assert FunctionRewardSource("engines.toy.task:reward_func").score(batch) == [1.0, 0.125]
    assert FunctionRewardSource("engines.toy.task:compute_score").score(batch) == [1.0, 0.125]


@pytest.mark.parametrize(
    "fn, message",
    [
        ("short", r"returned 1 rewards for 2 samples on iter 0 prompt 0 sample 0 \.\. iter 0 prompt 0 sample 1"),
        ("nan", r"returned nan for iter 0 prompt 0 sample 1"),
        ("boom", r"raised ZeroDivisionError: user bug on iter 0 prompt 0 sample 1"),
    ],
)
def test_errors_name_source_and_sample(reward_file, fn, message):
    source = FunctionRewardSource(f"{reward_file}:{fn}", name="acc")
    with pytest.raises(RewardError, match=r"'acc'.*" + message):
        source.score(_batch(["ok", "bad"]))


def test_timeout_is_an_error(reward_file):
    source = FunctionRewardSource(f"{reward_file}:slow", timeout_s=0.2)
    with pytest.raises(RewardError, match=r"timed out after 0.2 s"):
        source.score(_batch(["a"]))


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("no_colon", ValueError, "must be 'path/to/file.py:fn'"),
        ("/nowhere/r.py:f", FileNotFoundError, "file '/nowhere/r.py' not found"),
        ("no_such_pkg_xyz.mod:f", ImportError, "cannot import module 'no_such_pkg_xyz.mod'"),
        ("engines.toy.task:missing", AttributeError, "has no attribute 'missing'"),
    ],
)
def test_bad_specs(spec, error, message):
    with pytest.raises(error, match=message):
        load_reward_function(spec)


def test_not_callable_and_unknown_contract(reward_file):
    with pytest.raises(TypeError, match="not a function"):
        load_reward_function(f"{reward_file}:NOT_A_FUNCTION")
    with pytest.raises(TypeError, match=r"parameters \['a', 'b'\]"):
        detect_contract(load_reward_function(f"{reward_file}:unknown"), "x:unknown")


def test_identity_follows_the_code(tmp_path, reward_file):
    first = FunctionRewardSource(f"{reward_file}:verl").identity
    assert FunctionRewardSource(f"{reward_file}:verl").identity == first
    other = tmp_path / "other.py"
    other.write_text(REWARD_FILE.replace("else 0.5", "else 0.25"))
    # Same function name, different body -> a different identity (so the score cache cannot mix them).
    assert FunctionRewardSource(f"{other}:verl").identity != first


def test_scorer_weights_clips_and_adds_reference(reward_file, tiny_model_dir):
    from engines.scoring.reference import ReferenceModel
    from engines.scoring.scorer import Scorer, ScoringInput, build_reward_sources
    from ppoflow.config import load_config

    cfg = load_config(
        None,
        [
            f"model.policy_path={tiny_model_dir}",
            "reward.clip=1.5",
            f'reward.sources=[{{kind: function, target: "{reward_file}:openrlhf", weight: 2.0, name: len}},'
            f' {{kind: function, target: "{reward_file}:verl", weight: -1.0, name: exact}}]',
        ],
    )
    reference = ReferenceModel(str(tiny_model_dir), micro_batch_size=1)
    scorer = Scorer(cfg, reference=reference)
    inputs = [
        ScoringInput("p:", "7", [1, 14], [16], label="7", sample_id="s0"),
        ScoringInput("p:", "abc", [1, 14, 15], [17, 18, 2], label="7", sample_id="s1"),
    ]
    results = scorer.score(inputs)
    # s0: len 1, exact match 2.0 -> 2*1 - 2.0 = 0.0. s1: len 3, no match 0.5 -> 2*3 - 0.5 = 5.5, clipped to 1.5.
    assert [r.reward for r in results] == [0.0, 1.5]
    assert results[1].components == {"len": 3.0, "exact": 0.5}
    assert results[1].ref_logprobs == reference.logprobs([[1, 14, 15]], [[17, 18, 2]])[0]
    assert len(results[1].ref_logprobs) == 3
    # Identity follows the weights; duplicate source names are refused.
    heavier = cfg.model_copy(deep=True)
    heavier.reward.sources[0].weight = 3.0
    assert Scorer(heavier, reference=reference).identity != scorer.identity
    cfg.reward.sources[1].name = "len"
    with pytest.raises(ValueError, match=r"names \['len'\] are used twice"):
        build_reward_sources(cfg)


HELPER_FILE = textwrap.dedent("""
    def _points(solution_str):
        return 1.0 if solution_str.strip() == "7" else 0.0

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return _points(solution_str)
""")


def test_an_edited_helper_in_a_reward_file_is_a_new_score_cache_key(tmp_path, tiny_model_dir):
    """A file spec's identity holds the whole file: an edit to a helper the function calls (its own source
    unchanged) changes the scorer's identity, so the score stage's cache keys move and the old score is not
    served from the cache."""
    import fsspec

    from engines.scoring.cached import score_with_cache
    from engines.scoring.scorer import Scorer, ScoringInput
    from ppoflow.config import load_config
    from storage.score_cache import ScoreCache

    file = tmp_path / "reward.py"
    file.write_text(HELPER_FILE)
    cfg = load_config(
        None,
        [f"model.policy_path={tiny_model_dir}", f'reward.sources=[{{kind: function, target: "{file}:verl"}}]'],
    )
    sample = [ScoringInput("p:", "7", [1, 14], [16], label="7", sample_id="s0")]
    cache = ScoreCache(fsspec.filesystem("file"), str(tmp_path / "score-cache"))
    before = Scorer(cfg)
    results, stats = score_with_cache(before, sample, cache)
    assert [r.reward for r in results] == [1.0] and stats.computed == 1
    assert score_with_cache(Scorer(cfg), sample, cache)[1].hits == 1  # unchanged file: the same key, a hit

    file.write_text(HELPER_FILE.replace("1.0 if", "0.25 if"))
    after = Scorer(cfg)
    assert inspect.getsource(after.sources[0].fn) == inspect.getsource(before.sources[0].fn)  # verl itself
    assert after.identity != before.identity
    results, stats = score_with_cache(after, sample, cache)
    assert [r.reward for r in results] == [0.25] and stats.hits == 0 and stats.computed == 1
