"""Digest formats (engines/weights_digest.py DIGEST_FORMAT, stages/attest.py): a checkpoint whose trainer recorded its
policy digest with another digest algorithm is digested again from its own verified files, never compared as if
its weights differed; when those files cannot be read, the error names both formats.

The checkpoints are made by hand through storage/checkpoints.py (a copy of the tiny model as policy/, a trainer.json
holding a hand-written record), committed as the update and checkpoint stages commit theirs."""

from __future__ import annotations

import json
import shutil

import pytest

from engines.toy.run_config import toy_config
from engines.weights_digest import DIGEST_FORMAT, folder_digest, policy_record, record_format
from stages import attest
from stages.policy import policy_ref
from storage import fs as fsutil
from storage.checkpoints import commit_checkpoint, save_checkpoint_files
from storage.layout import layout_for

# A format-1 record as a ppoflow before formats were numbered wrote it: no "format", a value of its own algorithm.
OLD_RECORD = {"value": "00000000deadbeef00000000cafef00d", "dtypes": ["float32"], "rounded": {}}


@pytest.fixture(autouse=True)
def _no_records_kept_across_tests():
    attest._records.clear()  # expected_record keeps what it read per weights_id: each test reads its own
    yield
    attest._records.clear()


def _committed(tmp_path, tiny_model_dir, digits_dataset_dir, record):
    """A run whose checkpoint 1 is the tiny model with `record` as its trainer's policy digest; the config and
    iteration 2's PolicyRef (checkpoint 1)."""
    cfg = toy_config(tmp_path / "runs", "formats", tiny_model_dir, digits_dataset_dir, seed=3)
    local = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, local / "policy")
    (local / "trainer").mkdir()
    (local / "trainer" / "trainer.json").write_text(json.dumps({"policy_digest": record}))
    layout = layout_for(cfg)
    save_checkpoint_files(layout, 1, str(local))
    commit_checkpoint(layout, 1)
    return cfg, policy_ref(cfg, 2)


def test_a_record_carries_the_format_it_was_computed_in(tiny_model_dir):
    record = policy_record(tiny_model_dir)
    assert record["format"] == DIGEST_FORMAT == record_format(record)
    assert record_format(OLD_RECORD) == 1  # unnumbered: the first format


def test_an_old_format_record_is_digested_again_from_the_checkpoints_files(
    tmp_path, tiny_model_dir, digits_dataset_dir
):
    cfg, policy = _committed(tmp_path, tiny_model_dir, digits_dataset_dir, OLD_RECORD)
    expected = attest.expected_record(cfg, policy)
    # Independent of expected_record: the checkpoint's policy/ is a byte copy of the tiny model, so its digest in
    # this format is the tiny model folder's, and the old record's value is nowhere in it.
    assert expected["format"] == DIGEST_FORMAT
    assert expected["value"] == folder_digest(tiny_model_dir).value != OLD_RECORD["value"]


def test_a_current_format_record_is_taken_as_recorded(tmp_path, tiny_model_dir, digits_dataset_dir):
    current = {"format": DIGEST_FORMAT, **OLD_RECORD}  # a value the files do not have: read, not recomputed
    cfg, policy = _committed(tmp_path, tiny_model_dir, digits_dataset_dir, current)
    assert attest.expected_record(cfg, policy)["value"] == OLD_RECORD["value"]


def test_a_newer_format_is_digested_again_too(tmp_path, tiny_model_dir, digits_dataset_dir):
    newer = {"format": DIGEST_FORMAT + 1, **OLD_RECORD}  # written by a later ppoflow: its algorithm is unknown here
    cfg, policy = _committed(tmp_path, tiny_model_dir, digits_dataset_dir, newer)
    assert attest.expected_record(cfg, policy)["value"] == folder_digest(tiny_model_dir).value


def test_an_old_format_whose_files_cannot_be_read_names_both_formats(tmp_path, tiny_model_dir, digits_dataset_dir):
    cfg, policy = _committed(tmp_path, tiny_model_dir, digits_dataset_dir, OLD_RECORD)
    layout = layout_for(cfg)
    layout.fs.rm(fsutil.join(layout.checkpoint_dir(1), "policy", "model.safetensors"))  # the files are gone
    with pytest.raises(RuntimeError) as failed:
        attest.expected_record(cfg, policy)
    message = str(failed.value)
    assert f"records digest format v1, this ppoflow computes v{DIGEST_FORMAT}" in message
    assert "could not be digested instead" in message and "model.safetensors" in message
