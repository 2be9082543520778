"""The `kind: model` reward source applies the mean/std that reward-model training stores beside the weights."""

import json
import shutil

import pytest

from engines.rewards.base import RewardBatch, RewardError
from engines.rewards.model import RewardModelSource
from engines.rm.model import NORMALIZATION_FILE
from engines.toy.reward_model import build_tiny_reward_model


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm", seed=2)


BATCH = RewardBatch(
    ["say 3 : ", "repeat 4 : ", "copy number 5 : "], ["3 3", "4", "w1 5 5 5"], [[]] * 3, [[]] * 3, ["3", "4", "5"]
)


def test_scores_are_standardised_with_the_stored_mean_and_std(rm_dir, tmp_path):
    raw = RewardModelSource(rm_dir).score(BATCH)
    normalised_dir = tmp_path / "normalised"
    shutil.copytree(rm_dir, normalised_dir)
    (normalised_dir / NORMALIZATION_FILE).write_text(json.dumps({"mean": 0.25, "std": 4.0}))
    source = RewardModelSource(normalised_dir)
    assert source.score(BATCH) == pytest.approx([(r - 0.25) / 4.0 for r in raw], abs=1e-6)
    assert source.identity != RewardModelSource(rm_dir).identity  # a score-cache miss, never stale scores


@pytest.mark.parametrize(
    "content, why", [('{"mean": 1}', "std"), ('{"mean": 0, "std": 0}', "std finite and > 0"), ("not json", "must hold")]
)
def test_a_bad_normalisation_file_names_itself(rm_dir, tmp_path, content, why):
    folder = tmp_path / "bad"
    shutil.copytree(rm_dir, folder)
    (folder / NORMALIZATION_FILE).write_text(content)
    with pytest.raises(RewardError, match=f"{NORMALIZATION_FILE}.*{why}"):
        RewardModelSource(folder)
