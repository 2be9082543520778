"""score_with_cache (engines/scoring/cached.py) with the real Scorer: a real reference (the tiny Llama), real
FunctionRewardSources loaded from a file written here, and storage's ScoreCache on a local folder.

Work is counted where it happens, not from the cache's own stats: the reward file appends the size of every
call to a log, and a forward hook on the reference model counts the rows it scores. Expected rewards are
derived from the reward definitions by a second implementation in this file (`expected_reward`).
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.rewards.base import RewardError
from engines.scoring.cached import CacheStats, score_key, score_with_cache
from engines.scoring.scorer import Scorer, ScoringInput
from engines.toy.model import build_tokenizer
from ppoflow.config import build_config
from storage.score_cache import ScoreCache
from tests.fixtures.forward_calls import rows_scored

# A reward file with a call log. length_reward: OpenRLHF contract, batched, reward = words in the response.
# failing_score / hanging_score: veRL contract (one call per sample), so their errors name one sample.
REWARD_FILE = '''"""Test rewards that log every call (one line per call: the number of samples)."""
import time

LOG = {log!r}


def _log(n):
    with open(LOG, "a") as f:
        f.write(f"{{n}}\\n")


def length_reward(queries, prompts, labels, **kwargs):
    _log(len(queries))
    return {{"rewards": [float(len(q[len(p):].split())) for q, p in zip(queries, prompts)]}}


def failing_score(data_source, solution_str, ground_truth, extra_info=None):
    _log(1)
    if "w13" in solution_str.split():
        raise ValueError("cannot score the word w13")
    return float(len(solution_str.split()))


def hanging_score(data_source, solution_str, ground_truth, extra_info=None):
    _log(1)
    if "w13" in solution_str.split():
        time.sleep(3.0)
    return float(len(solution_str.split()))
'''


def write_reward_file(folder: Path) -> tuple[Path, Path]:
    """(reward file, call log) in `folder`; the log starts empty."""
    log = folder / "reward_calls.log"
    log.write_text("")
    path = folder / "counting_reward.py"
    path.write_text(REWARD_FILE.format(log=str(log)))
    return path, log


def samples_scored(log: Path) -> int:
    """Samples the logged reward functions received, summed over their calls."""
    return sum(int(line) for line in log.read_text().split())


def count_reference_rows(scorer: Scorer) -> tuple[list[int], object]:
    """([rows scored], hook handle): a forward pre-hook on the reference model, removed by the caller.

    A call whose rows share prompts runs them packed into one sequence (engines/trainer/shared_prompt.py): its rows
    are its layout's, not its input's one row."""
    rows: list[int] = []

    def count(module, args, kwargs):
        rows.append(rows_scored(kwargs))

    handle = scorer.reference.model.register_forward_pre_hook(count, with_kwargs=True)
    return rows, handle


def expected_reward(response: str, label: str, length_weight: float, digits_weight: float, clip: float) -> float:
    """A second implementation of the two rewards: words in the response, and the digits task's share
    of words equal to the label over max(words, 8); weighted sum, clipped."""
    words = response.split()
    digits = words.count(label) / max(len(words), 8)
    return max(-clip, min(clip, length_weight * len(words) + digits_weight * digits))


TOKENIZER = build_tokenizer()


def make_input(prompt: str, response: str, label: str, sample_id: str) -> ScoringInput:
    """A row as the rollout stage writes it: prompt ids with BOS, response text decoded from its ids."""
    response_ids = TOKENIZER(response, add_special_tokens=False)["input_ids"]
    return ScoringInput(
        prompt=prompt,
        response=TOKENIZER.decode(response_ids, skip_special_tokens=True),
        prompt_ids=TOKENIZER(prompt)["input_ids"],
        response_ids=response_ids,
        label=label,
        sample_id=sample_id,
    )


# Twelve distinct (prompt, response) pairs of different lengths.
DISTINCT = [
    make_input(f"say {d} :", " ".join([str(d)] * (1 + i % 5) + ["w3"] * (i % 3)), str(d), f"row {i}")
    for i, d in enumerate([3, 7, 1, 3, 0, 9, 7, 2, 5, 3, 8, 4])
]


def scorer_config(
    model_dir: Path,
    reward_file: Path,
    function: str = "length_reward",
    length_weight: float = 0.5,
    digits_weight: float = 2.0,
    clip: float = 10.0,
    timeout_s: float = 60.0,
):
    return build_config(
        {
            "model": {"policy_path": str(model_dir)},
            "train": {"micro_batch_size": 8},
            "reward": {
                "clip": clip,
                "sources": [
                    {
                        "kind": "function",
                        "target": f"{reward_file}:{function}",
                        "name": "length",
                        "weight": length_weight,
                        "timeout_s": timeout_s,
                    },
                    {
                        "kind": "function",
                        "target": "engines.toy.task:reward_func",
                        "name": "digits",
                        "weight": digits_weight,
                    },
                ],
            },
        }
    )


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> tuple[Path, Path]:
    return write_reward_file(tmp_path_factory.mktemp("rewards"))


@pytest.fixture(scope="module")
def scorer(tiny_model_dir, reward_file) -> Scorer:
    return Scorer(scorer_config(tiny_model_dir, reward_file[0]))


@pytest.fixture
def cache_dir(tmp_path, scorer) -> str:
    return str(tmp_path / "cache" / scorer.identity)


def local_cache(folder: str) -> ScoreCache:
    """A new reader/writer of `folder`, as a retried stage in a new process would open it."""
    return ScoreCache(fsspec.filesystem("file"), folder)


class TestScoreKey:
    def test_each_part_changes_the_key(self):
        base = score_key("scorer-a", [1, 2, 3], [4, 5])
        assert base == score_key("scorer-a", (1, 2, 3), (4, 5))  # lists or tuples: the ids decide
        assert base != score_key("scorer-b", [1, 2, 3], [4, 5])
        assert base != score_key("scorer-a", [1, 2, 4], [4, 5])
        assert base != score_key("scorer-a", [1, 2, 3], [4, 5, 6])

    def test_the_prompt_response_boundary_and_digit_runs_are_kept(self):
        # The same id sequence split differently, and ids whose digits run together, are other pairs.
        assert score_key("s", [1, 2], [3]) != score_key("s", [1], [2, 3])
        assert score_key("s", [1, 23], [4]) != score_key("s", [12, 3], [4])

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(st.integers(0, 300), max_size=6),
        st.lists(st.integers(0, 300), max_size=6),
        st.lists(st.integers(0, 300), max_size=6),
        st.lists(st.integers(0, 300), max_size=6),
    )
    def test_keys_are_equal_exactly_when_pairs_are(self, p1, r1, p2, r2):
        assert (score_key("s", p1, r1) == score_key("s", p2, r2)) == ((p1, r1) == (p2, r2))


class TestScoreWithCache:
    def test_warm_call_returns_exactly_what_a_fresh_computation_returns(self, scorer, reward_file, cache_dir):
        _, log = reward_file
        direct = scorer.score(DISTINCT)
        for x, result in zip(DISTINCT, direct):  # the scorer itself is right, by a second implementation
            assert result.reward == pytest.approx(expected_reward(x.response, x.label, 0.5, 2.0, 10.0), abs=1e-12)
            assert len(result.ref_logprobs) == len(x.response_ids)
        cold, cold_stats = score_with_cache(scorer, DISTINCT, local_cache(cache_dir))
        before_fn, (rows, hook) = samples_scored(log), count_reference_rows(scorer)
        try:
            warm, warm_stats = score_with_cache(scorer, DISTINCT, local_cache(cache_dir))
        finally:
            hook.remove()
        # Bit-for-bit: the same dataclass values (floats compared with ==), not approximately.
        assert cold == direct
        assert warm == direct
        assert (cold_stats.hits, cold_stats.misses, cold_stats.computed) == (0, 12, 12)
        assert warm_stats == CacheStats(hits=12, misses=0, computed=0, hit_mask=[True] * 12)
        assert samples_scored(log) == before_fn and rows == []  # the warm call ran no reward and no reference

    def test_duplicate_pairs_are_computed_once(self, scorer, reward_file, cache_dir):
        _, log = reward_file
        # 4 prompts x 4 samples, GRPO-style: the sampler repeats answers inside a group. New pairs by hand:
        # rows 0-3 -> 2, rows 4-7 -> 1, rows 8-11 -> 4, rows 12-15 -> 1 (rows 12 and 14 repeat row 0 of
        # another group): 2 + 1 + 4 + 1 = 8.
        groups = [
            (DISTINCT[0], DISTINCT[1], DISTINCT[0], DISTINCT[1]),
            (DISTINCT[2],) * 4,
            (DISTINCT[3], DISTINCT[4], DISTINCT[5], DISTINCT[6]),
            (DISTINCT[0], DISTINCT[7]) * 2,
        ]
        inputs = [
            ScoringInput(**{**vars(x), "sample_id": f"prompt {g} sample {s}"})
            for g, group in enumerate(groups)
            for s, x in enumerate(group)
        ]
        distinct = len({(tuple(x.prompt_ids), tuple(x.response_ids)) for x in inputs})
        assert distinct == 8
        before_fn, (rows, hook) = samples_scored(log), count_reference_rows(scorer)
        try:
            results, stats = score_with_cache(scorer, inputs, local_cache(cache_dir))
        finally:
            hook.remove()
        assert (stats.hits, stats.misses, stats.computed) == (0, 16, distinct)
        assert samples_scored(log) - before_fn == distinct  # the function saw each pair once
        assert sum(rows) == distinct  # so did the reference
        assert results[0] == results[2] == results[12] and results[4] == results[7]
        assert results[0].ref_logprobs is not results[2].ref_logprobs  # equal values, not shared lists

    def test_a_partly_warm_call_computes_only_the_missing_pairs(self, scorer, reward_file, cache_dir):
        _, log = reward_file
        score_with_cache(scorer, DISTINCT[:5], local_cache(cache_dir))
        before_fn = samples_scored(log)
        results, stats = score_with_cache(scorer, DISTINCT, local_cache(cache_dir))
        assert stats.hit_mask == [True] * 5 + [False] * 7
        assert (stats.hits, stats.misses, stats.computed) == (5, 7, 7)
        assert samples_scored(log) - before_fn == 7
        direct = scorer.score(DISTINCT)
        # Rewards are equal exactly; reference log-probs to float32 rounding: the cached 5 and the 7 computed
        # now went through other micro-batches than a direct call's, and a matmul's kernel (so its summation
        # order) may depend on how many rows it gets.
        assert [(r.reward, r.components) for r in results] == [(r.reward, r.components) for r in direct]
        for got, want in zip(results, direct):
            assert got.ref_logprobs == pytest.approx(want.ref_logprobs, abs=1e-6)

    def test_without_a_cache_pairs_are_still_deduplicated(self, scorer, reward_file):
        _, log = reward_file
        before_fn = samples_scored(log)
        results, stats = score_with_cache(scorer, DISTINCT[:3] * 3, None)
        assert (stats.hits, stats.misses, stats.computed) == (0, 9, 3)
        assert samples_scored(log) - before_fn == 3
        assert results[:3] == results[3:6] == results[6:]

    def test_cached_rewards_are_recombined_and_clipped_like_fresh_ones(self, tiny_model_dir, reward_file, tmp_path):
        # weight 10 on the length: row 0 ("3", label 3) sums to 10 * 1 + 2 * 1/8 = 10.25 and "w3 w4" to
        # 10 * 2 + 0 = 20, both clipped to 1.0; the cache keeps the raw components, so a hit must apply the
        # weights and the clip again.
        clipped = Scorer(scorer_config(tiny_model_dir, reward_file[0], length_weight=10.0, clip=1.0))
        inputs = [DISTINCT[0], make_input("say 3 :", "w3 w4", "3", "no digit")]
        cold, _ = score_with_cache(clipped, inputs, local_cache(str(tmp_path / "c")))
        warm, stats = score_with_cache(clipped, inputs, local_cache(str(tmp_path / "c")))
        assert stats.hits == 2 and warm == cold
        assert [r.reward for r in warm] == [1.0, 1.0]
        assert warm[0].components == {"length": 1.0, "digits": 0.125}

    def test_another_scorer_identity_never_reads_these_entries(self, scorer, tiny_model_dir, reward_file, cache_dir):
        score_with_cache(scorer, DISTINCT, local_cache(cache_dir))
        reweighted = Scorer(scorer_config(tiny_model_dir, reward_file[0], digits_weight=3.0))
        assert reweighted.identity != scorer.identity
        # Even handed the old scorer's folder by mistake, the keys differ: all misses, no stale reward.
        results, stats = score_with_cache(reweighted, DISTINCT, local_cache(cache_dir))
        assert (stats.hits, stats.computed) == (0, 12)
        assert [r.reward for r in results] == [r.reward for r in reweighted.score(DISTINCT)]

    @pytest.mark.parametrize(
        "function, message",
        [("failing_score", "raised ValueError: cannot score the word w13"), ("hanging_score", "timed out after 0.5 s")],
    )
    def test_a_failed_reward_names_the_sample_and_caches_nothing(
        self, tiny_model_dir, reward_file, tmp_path, function, message
    ):
        failing = Scorer(scorer_config(tiny_model_dir, reward_file[0], function=function, timeout_s=0.5))
        inputs = DISTINCT[:4] + [make_input("say 5 :", "5 w13 5", "5", "iter 2 prompt 9 sample 3")]
        cache = local_cache(str(tmp_path / "c"))
        with pytest.raises(RewardError, match=f"{message} on iter 2 prompt 9 sample 3"):
            score_with_cache(failing, inputs, cache)
        assert cache.total_bytes() == 0  # the four rows scored before the failure were not cached either


class TestKeyFor:
    def test_deterministic_hex(self):
        key = score_key("scorer", [1, 2], [3])
        assert key == score_key("scorer", (1, 2), (3,)) and len(key) == 64 and int(key, 16) >= 0

    def test_every_input_matters_including_the_boundary(self):
        keys = {
            score_key("scorer", [1, 2], [3]),
            score_key("scorer", [1], [2, 3]),
            score_key("other", [1, 2], [3]),
            score_key("scorer", [1, 2], [4]),
            score_key("scorer", [2, 1], [3]),
            score_key("scorer", [], [1, 2, 3]),
        }
        assert len(keys) == 6
