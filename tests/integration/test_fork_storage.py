"""A fork's references, pins and retention on a local folder and on the moto S3 server (no training: checkpoints
are small files committed through the real protocol). The reference names the parent's root URL, so a fork's
checkpoint N is fetched from the parent's prefix; nothing of the parent is copied into the fork's."""

from __future__ import annotations

import pytest

import storage.checkpoints as ckpt
from flows.fork import fork_run
from storage import lineage
from storage.fs import is_local, list_files
from storage.layout import RunLayout, layout_for
from storage.run_identity import new_run_record, read_run_record, write_run_record
from tests.integration.pipeline_helpers import small_config
from tests.integration.test_replay import counters  # noqa: F401 - the fixture counting engine and reward calls
from tests.integration.test_storage_s3_checkpoints import assert_loads_as, save_and_commit


def test_fork_references_and_retention(storage_root, tmp_path):
    root, storage_cfg = storage_root
    cfg = small_config(root, "base", tmp_path / "model", tmp_path / "data", iterations=4)
    cfg = cfg.model_copy(update={"storage": storage_cfg})
    parent = layout_for(cfg)
    parent.write_config_once(cfg.to_yaml())
    write_run_record(parent, new_run_record({}))
    files = {i: save_and_commit(parent, tmp_path, i, keep_last=1) for i in (1, 2)}

    fork = fork_run(root, "base", 2, "child", ["algo.kl_coef=0.5"], storage_cfg)
    child = layout_for(fork)
    assert read_run_record(child)["parent"]["root"] == root
    assert sorted(list_files(child.fs, child.run_dir)) == [
        "LATEST",
        "checkpoints/iter-000002/_REFERENCE.json",
        "config.yaml",
        "run.json",
    ]
    assert ckpt.latest_iteration(child) == 2
    assert_loads_as(child, 2, files[2], tmp_path / "cache")  # the parent's files, verified against its marker
    if is_local(child.fs):
        assert ckpt.load_checkpoint(child, 2) == parent.checkpoint_dir(2)

    save_and_commit(parent, tmp_path, 3, keep_last=1)
    assert ckpt.checkpoint_iterations(parent) == {2: True, 3: True}  # 2 pinned by the fork
    save_and_commit(child, tmp_path, 3, keep_last=1)  # the fork's own: its reference and the pin go
    assert ckpt.checkpoint_iterations(child) == {3: True}
    assert lineage.pinned_iterations(parent) == set()
    assert ckpt.apply_retention(parent, 1) == [2]
    assert ckpt.latest_iteration(RunLayout(root, "child", storage_cfg)) == 3


@pytest.mark.slow
def test_a_replayed_fork_trains_on_the_s3_server(
    prefect_api,
    s3_bucket,
    tmp_path,
    tiny_model_dir,
    digits_dataset_dir,
    counters,  # noqa: F811 - the fixture
):
    """End to end on the moto S3 server: the parent trains 1..3 (keeping checkpoints 2 and 3), a fork at 2 adds the
    `length` reward and replays 3 (test_replay.py does the same on a local disk). The fork generates nothing (the
    engine's generate is counted: 0 calls) and runs only the new source; its prefix holds no rollout shard, and
    its bytes for the shared part are < 1% of the parent's. The parent's retention down to one checkpoint keeps 2,
    which the fork still refers to: the fork's checkpoint 2 loads, as does its own 3."""
    from engines import warm
    from flows.training import ppo_training
    from storage.metrics import read_metrics
    from tests.integration.test_replay import LENGTH_REWARD

    bucket, storage_cfg = s3_bucket
    root = f"s3://{bucket}/runs"
    sections = {"storage": {"endpoint_url": storage_cfg.endpoint_url}, "run": {"keep_checkpoints": 2}}
    base = small_config(root, "base", tiny_model_dir, digits_dataset_dir, iterations=3, **sections)
    assert ppo_training(config=base.model_dump(mode="json"), return_state=True).is_completed()
    (tmp_path / "length.py").write_text(LENGTH_REWARD)
    reward = (
        "reward.sources=[{kind: function, target: 'engines.toy.task:reward_func'}, "
        f"{{kind: function, target: '{tmp_path}/length.py:length_reward', name: length, weight: 0.5}}]"
    )
    fork = fork_run(root, "base", 2, "replayed", [reward], base.storage, replay=1)

    warm.invalidate()
    counters.clear()
    assert ppo_training(config=fork.model_dump(mode="json"), return_state=True).is_completed()
    assert counters == {"reward:length": 1}
    parent, child = layout_for(base), layout_for(fork)
    (row,) = read_metrics(child)
    assert (row["iteration"], row["rollout/replayed"]) == (3, 1.0)

    parent_files, child_files = list_files(parent.fs, parent.run_dir), list_files(child.fs, child.run_dir)
    assert not any(name.startswith("iter-000003/rollout/") for name in child_files)
    shared = ("iter-000001/", "iter-000002/", "checkpoints/iter-000002/", "iter-000003/rollout/")
    standing_for_it = ("config.yaml", "run.json", "checkpoints/iter-000002/", "iter-000003/_stages/rollout.json")
    parent_bytes = sum(size for name, size in parent_files.items() if name.startswith(shared))
    fork_bytes = sum(size for name, size in child_files.items() if name.startswith(standing_for_it))
    print(f"S3: the replayed fork's bytes for the shared part {fork_bytes}, the parent's {parent_bytes}")
    assert fork_bytes < 0.01 * parent_bytes

    assert ckpt.apply_retention(parent, 1) == []  # 2 is pinned by the fork (keep_checkpoints=2: it keeps it)
    assert ckpt.checkpoint_iterations(parent) == {2: True, 3: True}
    for iteration in (2, 3):
        assert ckpt.read_commit_marker(child, iteration) is not None
        assert ckpt.load_checkpoint(child, iteration)  # fetched and verified against the owner's marker


def test_a_fork_under_a_relative_root_records_it_absolute(tmp_path, monkeypatch):
    # Issue 56: `ppoflow fork ... --root rt` saved `run.root: rt`, so the printed `ppoflow train <abs>/config.yaml`
    # run from another folder started a new run there. The fork's config.yaml now names the root absolutely.
    import yaml

    from flows.run_root import load_train_config

    monkeypatch.chdir(tmp_path)
    cfg = small_config("rt", "base", tmp_path / "model", tmp_path / "data", iterations=4)
    parent = layout_for(cfg)
    parent.write_config_once(cfg.to_yaml())
    write_run_record(parent, new_run_record({}))
    save_and_commit(parent, tmp_path, 1)
    fork = fork_run("rt", "base", 1, "child", ["algo.kl_coef=0.5"])
    child = layout_for(fork)
    saved = yaml.safe_load(child.fs.cat_file(child.config_path))
    assert saved["run"]["root"] == str(tmp_path / "rt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed, note = load_train_config(child.config_path)
    assert (resumed.run.root, note) == (str(tmp_path / "rt"), None)
