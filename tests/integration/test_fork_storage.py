"""A fork's references, pins and retention on a local folder and on the moto S3 server (no training: checkpoints
are small files committed through the real protocol). The reference names the parent's root URL, so a fork's
checkpoint N is fetched from the parent's prefix; nothing of the parent is copied into the fork's."""

from __future__ import annotations

import storage.checkpoints as ckpt
from flows.fork import fork_run
from storage import lineage
from storage.fs import is_local, list_files
from storage.layout import RunLayout, layout_for
from storage.run_identity import new_run_record, read_run_record, write_run_record
from tests.integration.pipeline_helpers import small_config
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
