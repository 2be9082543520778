"""train.optimizer_state_every = 2 on a 4-iteration PPO run (actor and critic, real DeepSpeed on CPU): only the
checkpoints of iterations 2 and 4 (every 2nd, and the run's last) hold the optimizer state, and a run SIGKILLed where
a resume must rebuild it ends byte for byte as a run never killed.

The killed run (tests/fixtures/kill_cli.py: SIGKILL at the N-th call of stages.update.train_on in that process):
    start 1  killed in iteration 2's update: checkpoint 1 (no optimizer state) is the newest;
    start 2  resumes at iteration 2 from checkpoint 1: the optimizer state is rebuilt by running iteration 1's update
             again from the initial model (stages/update_replay.py; that replay does not call train_on); killed in
             iteration 4's update, checkpoint 3 (no optimizer state) the newest, 2 the one with it;
    start 3  resumes at iteration 4: iteration 3's update replayed from checkpoint 2; the run ends.
Had a resume gone on with a fresh optimizer instead (the fallback when a replay does not reproduce the weights), the
weights and optimizer state of iterations 2 to 4 would differ from the never-killed run's; had the setting been
ignored, checkpoints 1 and 3 would hold optimizer files.

Then the fallback, in this process: with iteration 3's scored folder deleted, the trainer at checkpoint 3 cannot be
replayed to; it is built from checkpoint 3's weights with AdamW's moments at zero, and a warning says why.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

from tests.integration.pipeline_helpers import small_config
from tests.integration.test_pipeline_crash import _digests, _train

pytestmark = pytest.mark.slow
OPTIMIZER_FILES = {"trainer/actor_optimizer.safetensors", "trainer/critic_optimizer.safetensors"}


def _config_file(tmp_path: Path, root: str, name: str, model_dir, data_dir) -> Path:
    cfg = small_config(
        root,
        name,
        model_dir,
        data_dir,
        iterations=4,
        run={"keep_checkpoints": 4},
        train={"optimizer_state_every": 2},
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def test_a_run_killed_between_optimizer_states_resumes_exactly(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, caplog
):
    from storage.checkpoints import latest_iteration
    from storage.layout import RunLayout

    root = str(tmp_path / "runs")
    killed_path = _config_file(tmp_path, root, "killed", tiny_model_dir, digits_dataset_dir)
    killed = RunLayout(root, "killed")
    for kill, newest in (("stages.update:train_on@2", 1), ("stages.update:train_on@3", 3), (None, 4)):
        result = _train(killed_path, kill=kill)
        assert result.returncode == (0 if kill is None else -signal.SIGKILL), result.stderr[-3000:]
        assert latest_iteration(killed) == newest, (kill, result.stderr[-3000:])

    clean_path = _config_file(tmp_path, root, "never-killed", tiny_model_dir, digits_dataset_dir)
    assert _train(clean_path, fresh=True).returncode == 0
    clean = RunLayout(root, "never-killed")
    for iteration in range(1, 5):
        want = _digests(Path(clean.checkpoint_dir(iteration)))
        assert (OPTIMIZER_FILES <= set(want)) == (iteration in (2, 4)), (iteration, sorted(want))
        assert not OPTIMIZER_FILES & set(want) or iteration in (2, 4)
        assert "policy/model.safetensors" in want and "critic/model.safetensors" in want
        assert _digests(Path(killed.checkpoint_dir(iteration))) == want, iteration

    # The fallback: iteration 3's scored rows gone, the trainer at checkpoint 3 starts a fresh optimizer state.
    import shutil

    from engines.trainer.checkpoint import save_weights
    from ppoflow.config import load_config
    from stages.policy import policy_ref
    from stages.update_replay import resumed_trainer
    from storage.checkpoints import read_commit_marker

    shutil.rmtree(Path(killed.stage_dir(3, "scored")))
    cfg = load_config(str(killed_path))
    with caplog.at_level(logging.WARNING, logger="stages.update_replay"):
        trainer = resumed_trainer(cfg, policy_ref(cfg, 4))
    assert "checkpoint 3 holds no optimizer state" in caplog.text and "replaying iterations 3-3 failed" in caplog.text
    weights = save_weights(trainer, tmp_path / "fallback")
    files = read_commit_marker(killed, 3)["files"]
    assert weights and all(files[rel]["sha256"] == sha for rel, sha in weights.items())
    moments = [s["exp_avg"] for s in trainer.actor.optimizer.optimizer.state.values() if "exp_avg" in s]
    assert all(not bool(m.any()) for m in moments)
