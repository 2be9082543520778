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
    from storage.fs import write_json

    layout = RunLayout(str(tmp_path), "r")
    layout.write_config_once(load_config(None, ["run.name=r"]).to_yaml())
    write_json(layout.fs, layout.latest_path, {"iteration": 1})  # committed: its config is the run's
    before = open(layout.config_path).read()
    other = load_config(None, ["run.name=r", f"run.root={tmp_path}", "algo.kl_coef=0.5"])
    with pytest.raises(ConfigConflictError, match=r"differing keys: algo\.kl_coef, run\.root\."):
        layout.write_config_once(other.to_yaml())
    assert open(layout.config_path).read() == before


# A run's saved config trained from another working folder (issue 56): the run where the file is, never a new one.


def _saved_run(folder, root_in_file: str, name: str = "r"):
    """A run folder `folder/name` holding a config.yaml that says run.root=`root_in_file`, and a run.json."""
    from storage.run_identity import new_run_record, write_run_record

    layout = RunLayout(str(folder), name)
    layout.write_config_once(load_config(None, [f"run.name={name}", f"run.root={root_in_file}"]).to_yaml())
    write_run_record(layout, new_run_record({}))
    return layout


def test_absolute_root_resolves_against_the_working_folder_and_keeps_s3(tmp_path, monkeypatch):
    from flows.run_root import absolute_root

    monkeypatch.chdir(tmp_path)
    assert absolute_root(load_config(None, ["run.root=rt"])).run.root == str(tmp_path / "rt")
    assert absolute_root(load_config(None, ["run.root=./a/../rt"])).run.root == str(tmp_path / "rt")
    assert absolute_root(load_config(None, [f"run.root=file://{tmp_path}/x"])).run.root == str(tmp_path / "x")
    assert absolute_root(load_config(None, ["run.root=s3://b/p"])).run.root == "s3://b/p"


def test_a_saved_config_with_a_relative_root_resumes_where_it_is(tmp_path, monkeypatch):
    # Before: `ppoflow train /a/rt/r/config.yaml` run from /b trained at /b/rt/r, a new run.
    from flows.run_root import load_train_config

    run = _saved_run(tmp_path / "a" / "rt", "rt")
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    cfg, note = load_train_config(run.config_path)
    assert cfg.run.root == str(tmp_path / "a" / "rt")
    assert note and str(tmp_path / "b" / "rt" / "r") in note and "resumes where its config is" in note


def test_a_saved_config_found_where_its_root_says_needs_no_note(tmp_path, monkeypatch):
    from flows.run_root import load_train_config

    run = _saved_run(tmp_path / "rt", "rt")
    monkeypatch.chdir(tmp_path)
    assert load_train_config(run.config_path) == (load_config(run.config_path, [f"run.root={tmp_path}/rt"]), None)


def test_a_saved_config_whose_absolute_root_is_elsewhere_is_refused_with_both_places(tmp_path):
    from flows.run_root import load_train_config
    from ppoflow.config import ConfigError

    run = _saved_run(tmp_path / "copy", str(tmp_path / "original"))
    with pytest.raises(ConfigError) as err:
        load_train_config(run.config_path)
    text = str(err.value)
    assert f"at {tmp_path / 'copy' / 'r'}" in text and f"puts the run at {tmp_path / 'original' / 'r'}" in text
    assert f"--set run.root={tmp_path / 'copy'}" in text and "a new run would start there" in text
    # On purpose: --set run.root is obeyed as given, with no check.
    cfg, note = load_train_config(run.config_path, [f"run.root={tmp_path / 'original'}"])
    assert (cfg.run.root, note) == (str(tmp_path / "original"), None)


def test_a_config_that_is_no_run_s_saved_config_is_taken_as_written(tmp_path, monkeypatch):
    from flows.run_root import load_train_config

    (tmp_path / "r").mkdir()
    path = tmp_path / "r" / "config.yaml"  # named like a run folder, but no run.json beside it
    path.write_text("run: {name: r, root: rt}\n")
    monkeypatch.chdir(tmp_path)
    cfg, note = load_train_config(path)
    assert (cfg.run.root, note) == (str(tmp_path / "rt"), None)


def test_a_run_that_committed_nothing_takes_a_corrected_config(tmp_path):
    # Before: a start that failed in iteration 1 had written config.yaml, and the fix was a ConfigConflictError.
    from storage.fs import write_json

    layout = RunLayout(str(tmp_path), "r")
    layout.write_config_once(load_config(None, ["run.name=r"]).to_yaml())
    fixed = load_config(None, ["run.name=r", "data.max_prompt_tokens=64"])
    layout.write_config_once(fixed.to_yaml())
    assert yaml.safe_load(open(layout.config_path).read())["data"]["max_prompt_tokens"] == 64
    write_json(layout.fs, layout.latest_path, {"iteration": 1})  # iteration 1 committed: the config is the run's
    with pytest.raises(ConfigConflictError, match=r"differing keys: data\.max_prompt_tokens"):
        layout.write_config_once(load_config(None, ["run.name=r"]).to_yaml())
