"""The run's identity in the stage cache keys (storage/run_identity.py, tasks/cache_keys.py), and the check of its
input contents at every start (flows/run_inputs.py). Properties, not the code's own values: keys of the same
stage of two runs of one name must differ, a moved run's must not, a repair's disowning must change them; a
changed byte in an input must refuse the resume and name that input."""

from __future__ import annotations

import shutil

import pytest

from flows.run_inputs import InputsChangedError, accept_inputs, start_run
from ppoflow.config import PPOFlowConfig
from stages.manifests import PolicyRef
from storage.layout import layout_for
from storage.run_identity import disown_results, read_run_record
from tasks.cache_keys import stage_cache_key


def _config(root, model_dir, data_file, name="r") -> PPOFlowConfig:
    return PPOFlowConfig.model_validate(
        {
            "run": {"name": name, "root": str(root)},
            "model": {"policy_path": str(model_dir)},
            "data": {"path": str(data_file)},
        }
    )


@pytest.fixture
def inputs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    return model, data


def _rollout_key(cfg) -> str:
    return stage_cache_key(
        cfg, "rollout", 1, {"policy": PolicyRef(uri=cfg.model.policy_path, version=0, weights_id="w0")}
    )


def test_stage_keys_belong_to_one_run_and_move_with_it(tmp_path, inputs):
    a = _config(tmp_path / "root-a", *inputs)
    b = _config(tmp_path / "root-b", *inputs)  # same name, same config but the root
    for cfg in (a, b):
        start_run(cfg, layout_for(cfg))
    key_a = _rollout_key(a)
    assert key_a != _rollout_key(b)

    # the run folder moved to another root keeps its id: its completed stages are found again
    moved = _config(tmp_path / "root-c", *inputs)
    shutil.copytree(layout_for(a).run_dir, layout_for(moved).run_dir)
    assert _rollout_key(moved) == key_a

    # deleted and started again: a new run, new keys
    shutil.rmtree(layout_for(a).run_dir)
    start_run(a, layout_for(a))
    assert _rollout_key(a) != key_a

    # a repair disowns every result persisted before it
    before = _rollout_key(b)
    assert disown_results(layout_for(b)) == 1
    assert _rollout_key(b) != before


def test_a_resume_with_other_input_contents_is_refused_naming_them(tmp_path, inputs):
    model, data = inputs
    cfg = _config(tmp_path / "runs", model, data)
    layout = layout_for(cfg)
    first = start_run(cfg, layout)
    assert set(first["inputs"]) == {"model.policy_path", "data.path"}
    assert start_run(cfg, layout)["run_id"] == first["run_id"]  # unchanged contents: the same run resumes
    layout.fs.pipe_file(layout.latest_path, b'{"iteration": 1}')  # an iteration committed on those contents

    (model / "model.safetensors").write_bytes(b"\1" + b"\0" * 63)  # other weights, same size and name
    data.write_text('{"prompt": "2+2", "label": "4"}\n')
    with pytest.raises(InputsChangedError) as refused:
        start_run(cfg, layout)
    text = str(refused.value)
    assert "model.policy_path" in text and str(model) in text and "data.path" in text, text
    assert f"ppoflow runs accept-inputs {cfg.run.name}" in text, text
    assert read_run_record(layout)["inputs"] == first["inputs"]  # nothing recorded by the refused start

    assert sorted(accept_inputs(cfg, layout)) == ["data.path", "model.policy_path"]
    assert start_run(cfg, layout)["run_id"] == first["run_id"]  # accepted on purpose: it resumes
    assert read_run_record(layout)["accepted"][0]["previous"] == first["inputs"]


def test_before_the_first_commit_a_start_records_the_contents_it_finds(tmp_path, inputs):
    # A start that failed before committing (issue 56: a limit found in iteration 1) is corrected, data included:
    # nothing was trained on the first contents, so the corrected start is not refused.
    model, data = inputs
    cfg = _config(tmp_path / "runs", model, data)
    layout = layout_for(cfg)
    first = start_run(cfg, layout)
    data.write_text('{"prompt": "2+2", "label": "4"}\n')
    again = start_run(cfg, layout)
    assert again["run_id"] == first["run_id"]
    assert again["inputs"]["data.path"]["sha256"] != first["inputs"]["data.path"]["sha256"]
    assert read_run_record(layout)["inputs"] == again["inputs"]
