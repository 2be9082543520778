"""The rollout stage's dynamic-sampling rounds (stages/dynamic.py), with the round accounting by hand.

The sampler and the rewards are written here by hand (which rows vary is the test's choice), the prompts come
from a real PromptSource over the digits dataset, so the rows each round draws are the stage's own.
"""

import pyarrow as pa
import pytest

from engines.data import PromptSource
from engines.models import load_tokenizer
from engines.ppo.dynamic_sampling import extra_prompt_rows
from stages.dynamic import sample_dynamic
from tests.integration.pipeline_helpers import small_config

N = 2  # samples per prompt


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir, digits_dataset_dir):
    root = tmp_path_factory.mktemp("runs")
    cfg = small_config(
        str(root),
        "rounds",
        tiny_model_dir,
        digits_dataset_dir,
        rollout={"prompts_per_iteration": 4, "n_samples": N, "dynamic_sampling": {"enabled": True, "max_rounds": 3}},
        train={"train_batch_size": 4, "micro_batch_size": 4},  # 2 groups per optimizer step
    )
    return cfg, PromptSource(cfg.data, load_tokenizer(cfg.model.policy_path))


def _sampler(log):
    def sample(records):
        log.append([r.index for r in records])
        rows = [(r.index, s) for r in records for s in range(N)]
        return pa.table({"prompt_index": [p for p, _ in rows], "sample_index": [s for _, s in rows]})

    return sample


def _rewards(varied):
    # a varied row scores (0, 1), any other row (1, 1)
    return lambda table: [
        float(s) if p in varied else 1.0
        for p, s in zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist())
    ]


def test_rounds_by_hand(setup):
    cfg, source = setup
    seed, iteration = cfg.run.seed, 5
    round0 = source.row_indices(iteration, 4, seed)
    # round 1 asks for min(ceil(shortfall 2 x sampled 4 / kept 2), 4 x 2) = 4 rows, round 2 for
    # min(ceil(1 x 8 / 3), 4 x 1) = 3 rows (engines/ppo/dynamic_sampling.prompts_to_draw), none drawn before
    round1 = extra_prompt_rows(len(source), seed, iteration, 1, 4, exclude=round0)
    round2 = extra_prompt_rows(len(source), seed, iteration, 2, 3, exclude=round0 + round1)
    varied = {round0[0], round0[2], round1[1]}  # 2 varied in round 0, 1 in round 1, 0 in round 2
    log = []
    table, metrics = sample_dynamic(_sampler(log), source, cfg, iteration, _rewards(varied))
    assert log == [round0, round1, round2]
    # 3 varied groups < 4 wanted after the last round: whole steps of 2 groups -> the first two, in draw order
    assert table.column("prompt_index").to_pylist() == [round0[0], round0[0], round0[2], round0[2]]
    assert table.column("sample_index").to_pylist() == [0, 1, 0, 1]
    assert metrics == {
        "rollout/dynamic_rounds": 3.0,
        "rollout/groups_kept": 2.0,
        "rollout/groups_dropped": 9.0,  # 4 + 4 + 3 sampled - 2 kept
        "rollout/batch_filled": 0.0,
        "rollout/zero_variance_sampled_fraction": 8 / 11,
        "rollout/zero_variance_trained_fraction": 0.0,
        "rollout/first_round_reward_mean": (0.5 + 1 + 0.5 + 1) / 4,  # round 0: varied, flat, varied, flat
    }


def test_stops_when_the_batch_is_full(setup):
    cfg, source = setup
    round0 = source.row_indices(2, 4, cfg.run.seed)
    round1 = extra_prompt_rows(len(source), cfg.run.seed, 2, 1, 4, exclude=round0)  # shortfall 1 x 4 / 3 -> 2
    varied = set(round0[1:]) | set(round1[:2])  # round 0 keeps 3; round 1 draws ceil(1 x 4 / 3) = 2 rows, both vary
    log = []
    table, metrics = sample_dynamic(_sampler(log), source, cfg, 2, _rewards(varied))
    assert log == [round0, round1[:2]]
    assert table.column("prompt_index").to_pylist()[::N] == round0[1:] + [round1[0]]
    assert metrics["rollout/batch_filled"] == 1.0 and metrics["rollout/dynamic_rounds"] == 2.0
    assert metrics["rollout/groups_dropped"] == 2.0  # round0[0] (flat) and round1[1] (varied, not needed)


def test_same_inputs_same_rows(setup):
    cfg, source = setup
    varied = set(range(0, len(source), 3))
    first, _ = sample_dynamic(_sampler([]), source, cfg, 7, _rewards(varied))
    again, _ = sample_dynamic(_sampler([]), source, cfg, 7, _rewards(varied))
    assert first.equals(again)


def test_overlong_penalty_differences_are_a_signal(setup, tiny_model_dir, digits_dataset_dir, tmp_path):
    # every row's raw reward is 1.0; max_new_tokens 8, buffer 4, penalty 1: a 3-token response gets 0 and a
    # 6-token one -(6 - 4) / 4 = -0.5 (engines.ppo.rewards.overlong_penalty), so a (3, 6) group has advantages
    # in the update and a (6, 6) group has none
    _, source = setup
    cfg = small_config(
        str(tmp_path),
        "overlong",
        tiny_model_dir,
        digits_dataset_dir,
        rollout={
            "prompts_per_iteration": 4,
            "n_samples": N,
            "max_new_tokens": 8,
            "dynamic_sampling": {"enabled": True, "max_rounds": 3},
        },
        train={"train_batch_size": 4, "micro_batch_size": 4},
        reward={"overlong": {"buffer": 4, "penalty": 1.0}},
    )
    iteration = 2
    round0 = source.row_indices(iteration, 4, cfg.run.seed)
    # round 0 keeps 3 -> round 1 draws ceil(1 x 4 / 3) = 2 rows, as in test_stops_when_the_batch_is_full
    round1 = extra_prompt_rows(len(source), cfg.run.seed, iteration, 1, 2, exclude=round0)
    same_length = {round0[2]}

    def sample(records):
        log.append([r.index for r in records])
        rows = [(r.index, s) for r in records for s in range(N)]
        lengths = [6 if p in same_length or s == 1 else 3 for p, s in rows]
        return pa.table(
            {
                "prompt_index": [p for p, _ in rows],
                "sample_index": [s for _, s in rows],
                "response_ids": [[7] * length for length in lengths],
            }
        )

    log = []
    table, metrics = sample_dynamic(sample, source, cfg, iteration, lambda t: [1.0] * t.num_rows)
    assert log == [round0, round1]
    assert table.column("prompt_index").to_pylist()[::N] == [round0[0], round0[1], round0[3], round1[0]]
    assert metrics["rollout/batch_filled"] == 1.0
    assert metrics["rollout/zero_variance_sampled_fraction"] == 1 / 6  # round0[2] alone: equal penalties
    assert metrics["rollout/groups_dropped"] == 2.0  # round0[2] (flat) and round1[1] (varied, not needed)
