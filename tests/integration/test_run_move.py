"""A run folder moved to another root resumes there: train 2 iterations, move the folder, train to 3.

The old root is renamed away during the resume, so nothing of the run can be read from where it was.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow


def test_moved_run_resumes_at_its_new_root(prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir):
    import yaml

    from engines import warm
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.checkpoints import latest_iteration
    from storage.layout import layout_for

    old_root, new_root = tmp_path / "old-root", tmp_path / "new-root"
    first = small_config(str(old_root), "mover", tiny_model_dir, digits_dataset_dir, iterations=2)
    assert ppo_training(config=first.model_dump(mode="json"), return_state=True).is_completed()

    new_root.mkdir()
    shutil.move(old_root / "mover", new_root / "mover")
    os.rename(old_root, tmp_path / "old-root-gone")  # nothing may be read from the old place
    warm.invalidate()  # a new process on the new machine holds no engines
    resumed = small_config(str(new_root), "mover", tiny_model_dir, digits_dataset_dir, iterations=3)
    state = ppo_training(config=resumed.model_dump(mode="json"), return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert (result["first_iteration"], result["last_iteration"]) == (3, 3)
    layout = layout_for(resumed)
    assert latest_iteration(layout) == 3
    assert [r["iteration"] for r in read_metrics(layout)] == [1, 2, 3]
    assert yaml.safe_load(open(layout.config_path))["run"]["root"] == str(new_root)
    assert not old_root.exists()
