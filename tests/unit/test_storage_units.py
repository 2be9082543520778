"""Storage pieces that need no server: schema checks, part planning, cache keys, run layout, atomic writes."""

from __future__ import annotations

import itertools
import os

import pyarrow as pa
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ppoflow.config import PPOFlowConfig
from storage import fs as fsutil
from storage.layout import ConfigConflictError, RunLayout, fingerprint_component, parse_iteration_name
from storage.schema import SCHEMAS, SchemaMismatchError, validate
from storage.shards import plan_parts
from storage.synthetic import synthetic_table


class TestValidate:
    def test_each_kind_extends_the_previous(self):
        assert SCHEMAS["scored"].names[: len(SCHEMAS["rollout"])] == SCHEMAS["rollout"].names
        assert SCHEMAS["experience"].names[: len(SCHEMAS["scored"])] == SCHEMAS["scored"].names

    def test_reorders_columns_to_the_schema(self):
        table = synthetic_table("rollout", 3)
        shuffled = table.select(list(reversed(table.column_names)))
        assert validate(shuffled, "rollout").column_names == SCHEMAS["rollout"].names

    def test_null_in_non_nullable_column_is_named(self):
        table = synthetic_table("rollout", 2)
        holed = table.set_column(
            table.schema.get_field_index("response"), "response", pa.array(["ok", None], pa.string())
        )
        with pytest.raises(SchemaMismatchError, match=r"'response' holds 1 null"):
            validate(holed, "rollout")

    def test_extra_column_is_refused(self):
        table = synthetic_table("rollout", 2).append_column("surprise", pa.array([1, 2]))
        with pytest.raises(SchemaMismatchError, match="surprise"):
            validate(table, "rollout")

    def test_unknown_kind(self):
        with pytest.raises(ValueError, match="unknown shard kind 'rollouts'"):
            validate(synthetic_table("rollout", 1), "rollouts")


class TestPlanParts:
    @settings(max_examples=100, deadline=None)
    @given(
        rows=st.integers(0, 5000),
        row_bytes=st.integers(1, 4000),
        max_rows=st.integers(1, 900),
        max_bytes=st.integers(1024, 2**20),
    )
    def test_parts_cover_rows_in_order_within_bounds(self, rows, row_bytes, max_rows, max_bytes):
        plan = plan_parts(rows, rows * row_bytes, max_rows, max_bytes)
        assert sum(n for _, n in plan) == rows
        assert [o for o, _ in plan] == [0, *itertools.accumulate(n for _, n in plan[:-1])]
        if rows:
            sizes = [n for _, n in plan]
            assert max(sizes) <= max_rows and max(sizes) - min(sizes) <= 1  # balanced parts
            # Within the byte budget unless a single row is already larger than it.
            assert max(sizes) * row_bytes <= max_bytes or max(sizes) == 1

    def test_hand_example(self):
        # 10 rows of 100 bytes, at most 4 rows or 350 bytes (3 rows) per part: ceil(10/3) = 4 parts 3,3,2,2.
        assert plan_parts(10, 1000, 4, 350) == [(0, 3), (3, 3), (6, 2), (8, 2)]
        assert plan_parts(0, 0, 4, 350) == [(0, 0)]


class TestLayout:
    def test_paths(self, tmp_path):
        layout = RunLayout(str(tmp_path), "exp-1")
        assert layout.stage_dir(3, "rollout") == f"{tmp_path}/exp-1/iter-000003/rollout"
        assert layout.checkpoint_dir(12) == f"{tmp_path}/exp-1/checkpoints/iter-000012"
        assert layout.score_cache_dir("fp1") == f"{tmp_path}/cache/score/fp1"
        assert layout.results_dir == f"{tmp_path}/exp-1/_prefect_results"
        assert parse_iteration_name(layout.iteration_dir(7)) == 7 and parse_iteration_name("iter-x") is None
        with pytest.raises(ValueError, match="stage folder 'score'"):
            layout.stage_dir(1, "score")
        with pytest.raises(ValueError, match="non-negative int"):
            layout.iteration_dir(-1)
        with pytest.raises(ValueError, match="run name"):
            RunLayout(str(tmp_path), "a/b")

    def test_unsafe_fingerprints_are_hashed(self):
        assert fingerprint_component("abc-1.2") == "abc-1.2"
        hashed = fingerprint_component("model:/models/rm v2")
        assert len(hashed) == 32 and "/" not in hashed

    def test_file_url_and_relative_roots(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        assert RunLayout("./runs", "r").run_dir == f"{tmp_path}/runs/r"
        assert RunLayout(f"file://{tmp_path}/runs", "r").run_dir == f"{tmp_path}/runs/r"

    def test_write_config_once(self, tmp_path):
        layout = RunLayout(str(tmp_path), "r")
        cfg = PPOFlowConfig()
        layout.write_config_once(cfg.to_yaml())
        layout.write_config_once(cfg.to_yaml())  # same config: fine
        longer = cfg.model_copy(deep=True)
        longer.run.iterations = cfg.run.iterations + 5
        layout.write_config_once(longer.to_yaml())  # only run.iterations changed: accepted, rewritten
        saved = yaml.safe_load(open(layout.config_path).read())
        assert saved["run"]["iterations"] == cfg.run.iterations + 5
        fsutil.write_json(layout.fs, layout.latest_path, {"iteration": 1})  # committed: other settings conflict
        other = longer.model_copy(deep=True)
        other.algo.kl_coef = 0.5
        with pytest.raises(ConfigConflictError, match=r"hash [0-9a-f]{16}.*hash [0-9a-f]{16}.*algo\.kl_coef"):
            layout.write_config_once(other.to_yaml())


class TestAtomicWrite:
    def test_failed_local_write_leaves_old_file_and_no_temp(self, tmp_path, monkeypatch):
        fs, root = fsutil.resolve(str(tmp_path))
        target = fsutil.join(root, "d", "obj")
        fsutil.write_bytes_atomic(fs, target, b"old")

        def broken_replace(*_args):
            raise OSError("injected: disk full")

        monkeypatch.setattr(fsutil.os, "replace", broken_replace)
        with pytest.raises(OSError, match="disk full"):
            fsutil.write_bytes_atomic(fs, target, b"new")
        monkeypatch.undo()
        assert open(target, "rb").read() == b"old" and os.listdir(os.path.dirname(target)) == ["obj"]

    def test_join(self):
        assert fsutil.join("bucket/a/", "/b", "c/") == "bucket/a/b/c"
        assert fsutil.join("/", "x") == "/x"

    def test_read_json_missing_and_corrupt(self, tmp_path):
        fs, root = fsutil.resolve(str(tmp_path))
        assert fsutil.read_json(fs, f"{root}/absent.json") is None
        fsutil.write_bytes_atomic(fs, f"{root}/bad.json", b"{oops")
        with pytest.raises(ValueError, match="bad.json is not valid JSON"):
            fsutil.read_json(fs, f"{root}/bad.json")


class TestMoveFile:
    def test_local_move_renames_and_the_source_is_gone(self, tmp_path):
        src = tmp_path / "scratch" / "a.bin"
        src.parent.mkdir()
        src.write_bytes(b"x" * 1000)
        inode = os.stat(src).st_ino
        target = tmp_path / "ckpt" / "sub" / "a.bin"
        fs, _ = fsutil.resolve(str(tmp_path))
        fsutil.move_file_atomic(fs, str(src), str(target))
        assert target.read_bytes() == b"x" * 1000 and not src.exists()
        assert os.stat(target).st_ino == inode  # renamed, not copied
        assert not [p for p in target.parent.iterdir() if p.name != "a.bin"]  # no temp file left

    def test_remote_move_uploads_then_removes_the_source(self, tmp_path):
        import fsspec

        memory = fsspec.filesystem("memory")
        src = tmp_path / "b.bin"
        src.write_bytes(b"payload")
        fsutil.move_file_atomic(memory, str(src), "/bucket/run/b.bin")
        assert memory.cat_file("/bucket/run/b.bin") == b"payload" and not src.exists()


def test_a_setting_added_by_a_newer_version_at_its_default_is_no_config_conflict(tmp_path):
    import yaml

    from storage.layout import ConfigConflictError, RunLayout

    layout = RunLayout(str(tmp_path), "older")
    defaults = {"algo": {"kl_coef": 0.01, "tis_cap": None}, "rm_train": {"epochs": 1}}
    saved = {"algo": {"kl_coef": 0.02}}  # written by a version without algo.tis_cap and rm_train
    layout.write_config_once(yaml.safe_dump(saved))
    resumed = {"algo": {"kl_coef": 0.02, "tis_cap": None}, "rm_train": {"epochs": 1}}
    layout.write_config_once(yaml.safe_dump(resumed), defaults=defaults)  # new keys at their defaults: accepted
    layout.fs.pipe_file(layout.latest_path, b'{"iteration": 1}')  # committed: a changed setting conflicts
    with pytest.raises(ConfigConflictError, match="rm_train"):
        layout.write_config_once(
            yaml.safe_dump({"algo": {"kl_coef": 0.02}, "rm_train": {"epochs": 3}}), defaults=defaults
        )  # the saved config now holds rm_train.epochs=1
    with pytest.raises(ConfigConflictError, match="algo.kl_coef"):
        layout.write_config_once(
            yaml.safe_dump({**resumed, "algo": {"kl_coef": 0.05, "tis_cap": None}}), defaults=defaults
        )
