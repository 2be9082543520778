"""The root is where a run is, not what it is: config.yaml accepts another root, bucket or endpoint on resume."""

import pytest
import yaml

from ppoflow.config import load_config
from storage.layout import ConfigConflictError, RunLayout


def test_another_root_or_endpoint_is_not_a_conflict_and_is_saved(tmp_path):
    layout = RunLayout(str(tmp_path / "moved"), "r")
    first = load_config(None, ["run.root=./runs", "run.name=r"])
    layout.write_config_once(first.to_yaml())
    moved = load_config(
        None,
        [
            f"run.root={tmp_path / 'moved'}",
            "run.name=r",
            "storage.endpoint_url=http://x:9000",
            "storage.region=eu-west-1",
            "run.iterations=20",
        ],
    )
    layout.write_config_once(moved.to_yaml())
    saved = yaml.safe_load(open(layout.config_path).read())
    assert (saved["run"]["root"], saved["storage"]["endpoint_url"], saved["run"]["iterations"]) == (
        str(tmp_path / "moved"),
        "http://x:9000",
        20,
    )


def test_a_moved_run_with_another_setting_is_still_a_conflict(tmp_path):
    layout = RunLayout(str(tmp_path), "r")
    layout.write_config_once(load_config(None, ["run.name=r"]).to_yaml())
    before = open(layout.config_path).read()
    other = load_config(None, ["run.name=r", f"run.root={tmp_path}", "algo.kl_coef=0.5"])
    with pytest.raises(ConfigConflictError, match=r"differing keys: algo\.kl_coef, run\.root\."):
        layout.write_config_once(other.to_yaml())
    assert open(layout.config_path).read() == before
