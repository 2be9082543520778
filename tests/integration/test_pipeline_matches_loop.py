"""The pipeline's stages (through shards in storage) give what the bare engine loop gets with the same
compute passed in memory: same prompts, same samples, same rewards. And the worker's cached prompt set
follows the dataset's files, not just its path."""

from __future__ import annotations

import json

from engines.rollout.registry import get_rollout_engine
from engines.scoring.scorer import Scorer
from stages.held import prompt_source_for
from stages.policy import policy_ref
from stages.rollout import run_rollout, sample_rollout
from stages.score import run_score, score_rows
from storage.layout import layout_for
from storage.shards import read_shards
from tests.integration.pipeline_helpers import small_config


def test_rollout_and_score_stages_equal_the_bare_loop(tmp_path, tiny_model_dir, digits_dataset_dir):
    cfg = small_config(str(tmp_path / "runs"), "same", tiny_model_dir, digits_dataset_dir, score={"cache": False})
    iteration = 1
    rollout = run_rollout(cfg, iteration, policy_ref(cfg, iteration))
    scored_manifest = run_score(cfg, iteration, rollout)
    shards = read_shards(layout_for(cfg).fs, layout_for(cfg).stage_dir(iteration, "scored")).to_pydict()

    # The bare loop, in the same process: the engine registry hands out the same engine, so what must
    # agree is what the seeds and prompt selection decide.
    engine = get_rollout_engine(cfg.rollout, cfg.model, str(tiny_model_dir), 0, cfg.run.seed)
    source = prompt_source_for(cfg)
    in_memory = sample_rollout(engine, source, cfg, iteration)
    scored, _ = score_rows(Scorer(cfg), in_memory, cache=None)
    records = source.prompts_for_iteration(iteration, cfg.rollout.prompts_per_iteration, cfg.run.seed)

    assert in_memory.num_rows == rollout.rows == cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples
    # Rows come prompt by prompt, n samples each, in the order the data cursor drew the prompts.
    n = cfg.rollout.n_samples
    assert shards["prompt_index"] == [r.index for r in records for _ in range(n)]
    assert shards["sample_index"] == list(range(n)) * len(records)
    assert shards["response_ids"] == in_memory.column("response_ids").to_pylist()
    assert shards["reward"] == scored.column("reward").to_pylist()
    assert scored_manifest.reward_mean == sum(shards["reward"]) / len(shards["reward"])
    # Different iterations draw different samples (the seed depends on the iteration).
    other = sample_rollout(engine, source, cfg, iteration + 1)
    assert other.column("response_ids").to_pylist() != shards["response_ids"]


def test_prompt_set_is_rebuilt_when_the_dataset_file_changes(tmp_path, tiny_model_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{d} {d}"}) + "\n" for d in "12"))
    cfg = small_config(str(tmp_path / "runs"), "rebuild", tiny_model_dir, data, data={"label_key": None})
    first = prompt_source_for(cfg)
    assert prompt_source_for(cfg) is first  # cached while nothing changes
    data.write_text("".join(json.dumps({"prompt": f"{d} {d} {d}"}) + "\n" for d in "345"))
    second = prompt_source_for(cfg)
    assert second is not first
    assert second.texts == ["3 3 3", "4 4 4", "5 5 5"]


def test_rollout_takes_the_warm_trainers_weights_and_samples_what_the_checkpoint_gives(
    tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch
):
    import stages.rollout as rollout_stage
    from engines import warm
    from stages.checkpoint import run_checkpoint
    from stages.update import run_update

    cfg = small_config(
        str(tmp_path / "runs"),
        "memory",
        tiny_model_dir,
        digits_dataset_dir,
        model={"autocast_dtype": "bfloat16"},
        score={"cache": False},
    )
    first = policy_ref(cfg, 1)
    scored = run_score(cfg, 1, run_rollout(cfg, 1, first))
    run_checkpoint(cfg, 1, run_update(cfg, 1, first, scored))
    policy = policy_ref(cfg, 2)
    layout = layout_for(cfg)

    def no_folder(*args, **kwargs):
        raise AssertionError("the rollout fetched the checkpoint although the warm trainer holds it")

    # The trainer that wrote iteration 1's checkpoint is warm: its weights go to the engine in memory.
    monkeypatch.setattr(rollout_stage, "local_policy_dir", no_folder)
    in_memory = run_rollout(cfg, 2, policy)
    memory_rows = read_shards(layout.fs, layout.stage_dir(2, "rollout")).to_pydict()
    monkeypatch.undo()
    # Without a warm trainer the same stage loads the committed policy/ folder instead.
    warm.invalidate(warm.Role.TRAINER)
    from_folder = run_rollout(cfg, 2, policy)
    folder_rows = read_shards(layout.fs, layout.stage_dir(2, "rollout")).to_pydict()
    assert memory_rows["response_ids"] == folder_rows["response_ids"]
    assert memory_rows["rollout_logprobs"] == folder_rows["rollout_logprobs"]
    assert in_memory.content_hash == from_folder.content_hash
