"""The pipeline's stage bodies compute what the bare engine loop computes (a second implementation of the
same iteration): same prompts, same samples, same rewards. And the worker's cached prompt set follows
the dataset's files, not just its path."""
from __future__ import annotations

import json

import pyarrow as pa

from engines.loop import rollout_step, scoring_inputs
from engines.rollout.registry import get_rollout_engine
from engines.scoring.scorer import Scorer
from storage.shards import read_shards
from tasks.common import layout_for
from tasks.policy import policy_ref
from tasks.rollout import prompt_source_for, run_rollout
from tasks.score import run_score
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
    records, samples = rollout_step(engine, source, cfg, iteration)
    results = Scorer(cfg).score(scoring_inputs(source.tokenizer, records, samples, iteration))

    assert len(samples) == rollout["rows"] == cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples
    assert shards["prompt_index"] == [records[s.prompt_index].index for s in samples]
    assert shards["response_ids"] == [list(s.response_ids) for s in samples]
    assert shards["reward"] == [float(pa.scalar(r.reward, pa.float32()).as_py()) for r in results]
    assert scored_manifest["reward_mean"] == sum(shards["reward"]) / len(shards["reward"])
    # Different iterations draw different samples (the seed depends on the iteration).
    _, other = rollout_step(engine, source, cfg, iteration + 1)
    assert [list(s.response_ids) for s in other] != shards["response_ids"]


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
        tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch):
    import tasks.rollout as rollout_stage
    from engines import warm
    from tasks.checkpoint import run_checkpoint
    from tasks.update import TRAINER_ROLE, run_update

    cfg = small_config(str(tmp_path / "runs"), "memory", tiny_model_dir, digits_dataset_dir,
                       model={"autocast_dtype": "bfloat16"}, score={"cache": False})
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
    warm.invalidate(TRAINER_ROLE)
    from_folder = run_rollout(cfg, 2, policy)
    folder_rows = read_shards(layout.fs, layout.stage_dir(2, "rollout")).to_pydict()
    assert memory_rows["response_ids"] == folder_rows["response_ids"]
    assert memory_rows["rollout_logprobs"] == folder_rows["rollout_logprobs"]
    assert in_memory["content_hash"] == from_folder["content_hash"]
