"""A resume refuses a model folder whose content changed under the same path (issue 40): before, it resumed and
trained the committed checkpoint against the new folder's weights (a new reference model) without a word.

Train one iteration, swap the policy folder for a tiny Llama of another seed (same shapes, other weights), and
start the run again for a second iteration: the flow fails before any stage runs, naming model.policy_path,
and nothing is committed. `ppoflow runs accept-inputs` then lets it continue."""

from __future__ import annotations

import shutil

import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow


def test_a_swapped_model_folder_stops_the_resume_until_accepted(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, capsys
):
    from engines import warm
    from engines.toy.model import build_tiny_llama
    from flows.records import read_metrics
    from flows.run_inputs import InputsChangedError, accept_inputs
    from flows.training import ppo_training
    from storage.checkpoints import latest_iteration
    from storage.layout import layout_for

    model = tmp_path / "policy"
    shutil.copytree(tiny_model_dir, model)
    one = small_config(str(tmp_path / "runs"), "swapped", model, digits_dataset_dir, iterations=1)
    assert ppo_training(config=one.model_dump(mode="json"), return_state=True).is_completed()

    shutil.rmtree(model)
    build_tiny_llama(model, seed=1)  # same shapes and tokenizer, other weights
    warm.invalidate()
    two = small_config(str(tmp_path / "runs"), "swapped", model, digits_dataset_dir, iterations=2)
    state = ppo_training(config=two.model_dump(mode="json"), return_state=True)
    assert state.is_failed(), state
    with pytest.raises(InputsChangedError, match=r"model\.policy_path \(.*policy\)"):
        state.result()
    layout = layout_for(two)
    assert latest_iteration(layout) == 1 and [r["iteration"] for r in read_metrics(layout)] == [1]
    assert not layout.fs.exists(layout.iteration_dir(2))  # refused before any stage ran

    # `ppoflow runs accept-inputs RUN --root ROOT`, the command the refusal names
    from cli.main import main

    assert main(["runs", "accept-inputs", "swapped", "--root", str(tmp_path / "runs")]) == 0
    assert "accepted the current contents of model.policy_path" in capsys.readouterr().out
    assert accept_inputs(two, layout) == []  # recorded: nothing left to accept
    assert ppo_training(config=two.model_dump(mode="json"), return_state=True).is_completed()
    assert latest_iteration(layout) == 2
