"""The score cache keys on the reward inputs beyond the tokens (label, data_source) when a source reads them.

Two datasets with the same prompt and different labels used to share hits: the second got the first's
digits reward. Scored here with the real Scorer (tiny reference, real function sources) and storage's
ScoreCache; expected rewards come from the second implementation in test_score_cache_logic.
"""

from __future__ import annotations

import dataclasses

import pytest

from engines.scoring.cached import score_inputs_read, score_key, score_with_cache
from engines.scoring.scorer import Scorer
from tests.unit.test_score_cache_logic import expected_reward, local_cache, make_input, scorer_config, write_reward_file


@pytest.fixture(scope="module")
def scorer(tiny_model_dir, tmp_path_factory) -> Scorer:
    reward_file, _log = write_reward_file(tmp_path_factory.mktemp("rewards"))
    return Scorer(scorer_config(tiny_model_dir, reward_file, length_weight=0.5, digits_weight=2.0))


def test_same_prompt_other_label_is_a_miss_with_its_own_reward(scorer, tmp_path):
    folder = str(tmp_path / "cache" / scorer.identity)
    dataset_a = [make_input("say 3 :", "3 3 3", "3", "a row 0")]
    dataset_b = [dataclasses.replace(dataset_a[0], label="7", sample_id="b row 0")]
    first, stats_a = score_with_cache(scorer, dataset_a, local_cache(folder))
    second, stats_b = score_with_cache(scorer, dataset_b, local_cache(folder))
    assert (stats_a.hits, stats_b.hits, stats_b.computed) == (0, 0, 1)
    # Three words, 0.5 each = 1.5; digits reward = share of words equal to the label over max(3, 8) = 8:
    # label 3 -> 3/8 * 2.0 = 0.75 (total 2.25); label 7 -> 0 (total 1.5).
    assert first[0].reward == pytest.approx(expected_reward("3 3 3", "3", 0.5, 2.0, 10.0)) == pytest.approx(2.25)
    assert second[0].reward == pytest.approx(expected_reward("3 3 3", "7", 0.5, 2.0, 10.0)) == pytest.approx(1.5)
    again, stats_again = score_with_cache(scorer, dataset_a + dataset_b, local_cache(folder))
    assert stats_again.hits == 2 and [r.reward for r in again] == [first[0].reward, second[0].reward]


def test_data_source_is_in_the_key_of_a_scorer_that_reads_it(scorer):
    assert score_inputs_read(scorer) == ("label", "data_source")
    base = score_key("s", [1, 2], [3], {"label": "3", "data_source": "digits"})
    assert base != score_key("s", [1, 2], [3], {"label": "3", "data_source": "gsm8k"})
    assert base != score_key("s", [1, 2], [3], {"label": "4", "data_source": "digits"})


class _TextOnlySource:
    """A source that scores the text only (as a reward model does)."""

    name, identity, reward_inputs = "rm", "rm-v1", ()

    def score(self, batch):
        return [float(len(r)) for r in batch.responses]


class _Reference:
    fingerprint, micro_batch_size = "ref", 8

    def logprobs(self, prompt_ids, response_ids):
        return [[-1.0] * len(r) for r in response_ids]


def test_a_text_only_scorer_shares_hits_across_labels(tmp_path):
    from ppoflow.config import PPOFlowConfig

    scorer = Scorer(PPOFlowConfig(), sources=[_TextOnlySource()], reference=_Reference())
    assert score_inputs_read(scorer) == ()
    assert score_key("s", [1], [2], {}) == score_key("s", [1], [2])  # tokens alone: the old key
    folder = str(tmp_path / "cache")
    row = make_input("say 3 :", "3 3", "3", "a")
    score_with_cache(scorer, [row], local_cache(folder))
    _, stats = score_with_cache(scorer, [dataclasses.replace(row, label="9")], local_cache(folder))
    assert stats.hits == 1


def test_a_scorer_that_does_not_say_what_it_reads_keys_on_both():
    assert score_inputs_read(object()) == ("label", "data_source")
