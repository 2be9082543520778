"""Groups are draws of a prompt, not dataset rows: an iteration that crosses an epoch boundary of the prompt
stream can hold the same dataset row twice, and the trainer must see two groups (it used to refuse the batch:
"group N is not contiguous", the first time a run's prompts_per_iteration did not divide the dataset)."""

import pytest

from engines.data import PromptSource
from engines.models import load_tokenizer
from engines.rollout.base import RolloutSample
from engines.scoring.scorer import ScoreResult
from ppoflow.config import DataConfig
from stages.tables import experience_batch, group_ids_of, rollout_table, scored_table

N_SAMPLES = 2


def test_group_ids_by_hand():
    assert group_ids_of([0, 1, 0, 1, 0, 1]) == [0, 0, 1, 1, 2, 2]
    assert group_ids_of([0, 0, 0]) == [0, 1, 2]  # n_samples = 1: every row its own group
    assert group_ids_of([]) == []
    with pytest.raises(ValueError, match="row 1: sample_index 2 after 0"):
        group_ids_of([0, 2])
    with pytest.raises(ValueError, match="row 0: sample_index 1 after None"):
        group_ids_of([1, 0])


def _first_repeat(rows: list[int]) -> int:
    seen = set()
    for r in rows:
        if r in seen:
            return r
        seen.add(r)
    return -1


def test_an_iteration_across_an_epoch_boundary_trains_a_repeated_prompt_as_two_groups(
    digits_dataset_dir, tiny_model_dir
):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    source = PromptSource(DataConfig(path=str(digits_dataset_dir)), tokenizer)
    count = 100  # iteration 2 covers stream positions 200..299: epoch 0 [200:256] + epoch 1 [0:44]
    seed = next(s for s in range(50) if _first_repeat(source.row_indices(2, count, s)) >= 0)
    records = source.prompts_for_iteration(2, count, seed)
    repeated = _first_repeat([r.index for r in records])
    positions = [p for p, r in enumerate(records) if r.index == repeated]
    assert len(positions) == 2 and positions[1] > positions[0] + 1  # the precondition: one row, two draws

    samples = [
        RolloutSample(p, s, list(r.prompt_ids), [5 + s], [-0.5], "stop")
        for p, r in enumerate(records)
        for s in range(N_SAMPLES)
    ]
    rollout = rollout_table(records, samples, tokenizer, iteration=2)
    results = [ScoreResult(float(i % 3), {"r": 0.0}, [-1.0]) for i in range(rollout.num_rows)]
    batch = experience_batch(scored_table(rollout, results, [False] * rollout.num_rows), pad_token_id=0)

    ids = batch.group_ids.tolist()
    assert ids == [p for p in range(count) for _ in range(N_SAMPLES)]
    # the repeated dataset row is two groups of N_SAMPLES rows each, as any other prompt
    rows_of_repeat = [b for b, p in enumerate(rollout.column("prompt_index").to_pylist()) if p == repeated]
    assert len({ids[b] for b in rows_of_repeat}) == 2
