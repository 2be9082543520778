"""Preflight's pure checks: data files named with the line, model folders with the file, read-only."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.data import DataError, PromptSource, check_dataset
from engines.model_files import model_folder_problems, safetensors_problem
from engines.models import load_tokenizer
from flows.preflight_static import PreflightError, check_static, label_readers, static_problems
from ppoflow.config import DataConfig, load_config


def _data(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), **kw)


class TestCheckDataset:
    def test_good_jsonl_counts_rows_and_skips_blank_lines(self, tmp_path):
        path = tmp_path / "d.jsonl"
        path.write_text('{"prompt": "a", "label": "1"}\n\n{"prompt": "b", "label": "2"}\n')
        assert check_dataset(_data(path)) == 2

    def test_non_utf8_names_file_line_and_byte(self, tmp_path):
        path = tmp_path / "d.jsonl"
        # Line 2 holds 0xff at byte 12 of the line: '{"prompt": "' is 12 bytes (0..11).
        path.write_bytes(b'{"prompt": "a", "label": "1"}\n{"prompt": "\xff", "label": "2"}\n')
        with pytest.raises(DataError, match=r"d.jsonl' line 2: not UTF-8 \(byte 0xff at byte 12"):
            check_dataset(_data(path))

    def test_non_utf8_line_is_counted_across_read_blocks(self, tmp_path, monkeypatch):
        import engines.data

        monkeypatch.setattr(engines.data, "_BLOCK_BYTES", 64)  # ~2 lines per block instead of 16 MiB
        good = '{"prompt": "a", "label": "1"}\n'.encode()
        path = tmp_path / "d.jsonl"
        # 40 good lines, then line 41 with 0xe9 (latin-1 e-acute) after '{"prompt": "caf' (15 bytes).
        path.write_bytes(good * 40 + b'{"prompt": "caf\xe9", "label": "2"}\n' + good)
        with pytest.raises(DataError, match=r"line 41: not UTF-8 \(byte 0xe9 at byte 15 of the line\)"):
            check_dataset(_data(path))

    def test_empty_file(self, tmp_path):
        path = tmp_path / "d.jsonl"
        path.write_text("\n \n")
        with pytest.raises(DataError, match=r"d.jsonl' is empty"):
            check_dataset(_data(path))

    @pytest.mark.parametrize(
        "line, message",
        [
            ('{"prompt": "b"', r"line 2: not JSON"),
            ('["b", "2"]', r"line 2: a JSON list"),
            ('{"prompt": "b"}', r"line 2: no key 'label' \(data.label_key\)"),
            ('{"prompt": 7, "label": "2"}', r"line 2: the prompt \(data.prompt_key='prompt'\) is a int"),
        ],
    )
    def test_bad_second_line_is_named(self, tmp_path, line, message):
        path = tmp_path / "d.jsonl"
        path.write_text('{"prompt": "a", "label": "1"}\n' + line + "\n")
        with pytest.raises(DataError, match=message):
            check_dataset(_data(path))

    def test_parquet_columns_type_and_rows_from_metadata(self, tmp_path):
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"question": ["a"], "label": ["1"]}), path)
        with pytest.raises(DataError, match=r"no column 'prompt' \(data.prompt_key\).*\['question', 'label'\]"):
            check_dataset(_data(path))
        pq.write_table(pa.table({"prompt": [1, 2], "label": ["1", "2"]}), path)
        with pytest.raises(DataError, match=r"prompt column 'prompt' holds int64"):
            check_dataset(_data(path))
        pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.string())}), path)
        with pytest.raises(DataError, match="has no rows"):
            check_dataset(_data(path))
        path.write_bytes(b"PAR1 not really")
        with pytest.raises(DataError, match=r"d.parquet' is not a readable Parquet file"):
            check_dataset(_data(path))

    def test_datasets_folder_and_missing_path(self, digits_dataset_dir, tmp_path):
        assert check_dataset(_data(digits_dataset_dir, data_source_key="data_source")) == 256
        with pytest.raises(DataError, match="no column 'answer'"):
            check_dataset(_data(digits_dataset_dir, label_key="answer"))
        with pytest.raises(DataError, match=r"nope.jsonl' not found"):
            check_dataset(_data(tmp_path / "nope.jsonl"))

    @pytest.mark.parametrize("prompt, what", [('""', "empty"), ('"  \\t "', "only whitespace ('  \\t ')")])
    def test_a_blank_prompt_is_named_by_its_line(self, tmp_path, prompt, what):
        # Before: trained on (a tokenizer's BOS made the empty prompt one token long, so no length check caught it).
        path = tmp_path / "d.jsonl"
        path.write_text('{"prompt": "a", "label": "1"}\n\n{"prompt": ' + prompt + ', "label": "2"}\n')
        with pytest.raises(DataError) as err:
            check_dataset(_data(path))
        # The file's third line holds it (the blank line 2 is skipped).
        assert str(err.value).startswith(
            f"dataset {str(path)!r} line 3: the prompt (data.prompt_key='prompt') is {what}:"
        )

    def test_a_null_label_is_refused_only_when_a_reward_source_is_passed_labels(self, tmp_path):
        path = tmp_path / "d.jsonl"
        path.write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": null}\n')
        assert check_dataset(_data(path)) == 2  # no reader of labels: nobody would get the None
        readers = ["reward.sources.1 (function my.py:fn)"]
        with pytest.raises(DataError) as err:
            check_dataset(_data(path), readers)
        assert str(err.value).startswith(
            f"dataset {str(path)!r} line 2: the label (data.label_key='label') is null, and "
            "reward.sources.1 (function my.py:fn) would be passed it as None;"
        )
        assert check_dataset(_data(path, label_key=None), readers) == 2  # labels not read from the data at all

    def test_parquet_and_folder_rows_are_read_for_blank_prompts_and_null_labels(self, tmp_path):
        import datasets

        readers = ["reward.sources.0 (remote http://127.0.0.1:1/score)"]
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"prompt": ["a", "b", "c", " "], "label": ["1", "2", "3", "4"]}), path)
        with pytest.raises(DataError, match=r"d.parquet' row 3: the prompt \(data.prompt_key='prompt'\) is only"):
            check_dataset(_data(path))
        folder = tmp_path / "ds"
        datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "label": ["1", None, "3"]}).save_to_disk(str(folder))
        assert check_dataset(_data(folder)) == 3
        with pytest.raises(DataError, match=r"ds' row 1: the label \(data.label_key='label'\) is null, and reward"):
            check_dataset(_data(folder), readers)

    def test_prompt_source_refuses_a_blank_prompt_by_row(self, tmp_path, tiny_model_dir):
        # A pool worker builds PromptSource without preflight; rows count from 0, as its other errors do.
        import datasets

        folder = tmp_path / "ds"
        datasets.Dataset.from_dict({"prompt": ["a", "b", "\n"], "label": ["1", "2", "3"]}).save_to_disk(str(folder))
        with pytest.raises(ValueError, match=r"ds' row 2: the prompt \(data.prompt_key='prompt'\) is only whitespace"):
            PromptSource(_data(folder), load_tokenizer(tiny_model_dir))

    def test_prompt_source_names_the_line_of_a_bad_jsonl_too(self, tmp_path, tiny_model_dir):
        # A pool worker builds PromptSource without preflight: datasets' own error names no line, ours does.
        path = tmp_path / "d.jsonl"
        path.write_bytes(b'{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": "\xfe"}\n')
        with pytest.raises(DataError, match=r"d.jsonl' line 2: not UTF-8"):
            PromptSource(_data(path), load_tokenizer(tiny_model_dir))


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


class TestModelFolders:
    def test_the_tiny_model_passes(self, tiny_model_dir):
        assert model_folder_problems(str(tiny_model_dir), "model.policy_path") == []

    def test_truncated_safetensors_names_the_file_and_sizes(self, model_copy):
        weights = model_copy / "model.safetensors"
        full = weights.stat().st_size
        with open(weights, "r+b") as f:
            f.truncate(full - 100)
        problem = safetensors_problem(str(weights))
        # The header still describes the untruncated file: it ends at `full`, 100 bytes more than is there.
        assert problem == f"{weights}: {full - 100} bytes but its header describes {full} bytes (truncated)"
        with open(weights, "r+b") as f:
            f.truncate(5)
        assert "too short for a safetensors header" in safetensors_problem(str(weights))

    def test_garbage_header_and_missing_pieces(self, model_copy):
        weights = model_copy / "model.safetensors"
        weights.write_bytes((4).to_bytes(8, "little") + b"{no}")
        assert "safetensors header is not valid" in safetensors_problem(str(weights))
        (model_copy / "tokenizer.json").unlink()
        (model_copy / "config.json").write_text("{broken")
        problems = model_folder_problems(str(model_copy), "model.policy_path")
        assert any("config.json: not valid JSON" in p for p in problems)
        assert any("no tokenizer files" in p for p in problems)
        assert all(p.startswith("model.policy_path: ") for p in problems)

    def test_index_with_a_missing_shard(self, model_copy):
        (model_copy / "model.safetensors.index.json").write_text(
            json.dumps(
                {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
            )
        )
        (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
        problems = model_folder_problems(str(model_copy), "model.critic_path", need_tokenizer=False)
        assert problems == [
            f"model.critic_path: {model_copy / 'model.safetensors.index.json'} lists shards that "
            f"are missing: ['model-00002-of-00002.safetensors']"
        ]


def test_static_problems_are_all_listed_and_nothing_is_written(tiny_model_dir, digits_dataset_dir, tmp_path):
    good = [
        "model.policy_path=" + str(tiny_model_dir),
        "data.path=" + str(digits_dataset_dir),
        "run.root=" + str(tmp_path / "runs"),
    ]
    assert static_problems(load_config(None, good)) == []
    bad = good + [
        "data.label_key=answer",
        "model.critic_path=" + str(tmp_path / "critic"),
        "reward.sources=[{kind: function, target: 'rewards/nope.py:fn'}]",
    ]
    with pytest.raises(PreflightError) as err:
        check_static(load_config(None, bad))
    text = str(err.value)
    assert "3 problems" in text and "no column 'answer'" in text
    assert f"model.critic_path: model folder '{tmp_path / 'critic'}' not found" in text
    assert "reward.sources.0.target: reward function file 'rewards/nope.py' not found" in text
    assert not (tmp_path / "runs").exists()


def test_label_readers_are_the_function_and_remote_sources(tmp_path):
    cfg = load_config(
        None,
        [
            "reward.sources=[{kind: model, target: rm}, {kind: function, target: 'a.py:f'},"
            " {kind: remote, target: 'http://127.0.0.1:8000/score'}]"
        ],
    )
    assert label_readers(cfg) == [
        "reward.sources.1 (function a.py:f)",
        "reward.sources.2 (remote http://127.0.0.1:8000/score)",
    ]


class TestTokenizer:
    def test_a_corrupt_tokenizer_json_names_the_file_and_the_policy_field(self, model_copy):
        tokenizer_json = model_copy / "tokenizer.json"
        text = tokenizer_json.read_text()
        tokenizer_json.write_text(text[: len(text) // 2])  # a download cut off half-way
        (problem,) = model_folder_problems(str(model_copy), "model.policy_path")
        assert problem.startswith(f"model.policy_path: {tokenizer_json}: not valid JSON (")
        assert problem.endswith("), so the tokenizer cannot load")

    def test_a_tokenizer_that_does_not_load_is_the_policy_folder_s_problem(
        self, model_copy, digits_dataset_dir, tmp_path
    ):
        # Valid JSON, so the folder check passes; the load fails. Before: "data.path: ..." (the wrong field).
        from flows.preflight import preflight

        (model_copy / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
        cfg = load_config(
            None,
            [f"model.policy_path={model_copy}", f"data.path={digits_dataset_dir}", f"run.root={tmp_path / 'runs'}"],
        )
        with pytest.raises(PreflightError) as err:
            preflight(cfg)
        (problem,) = str(err.value).splitlines()[1:]
        assert problem.startswith(f"  model.policy_path: the tokenizer in {model_copy} does not load: ")
        assert problem.endswith("(its files: tokenizer.json, tokenizer_config.json)")


def test_a_conversation_longer_than_the_policy_s_context_is_found_with_a_fix_that_validates(
    tiny_model_dir, digits_dataset_dir, tmp_path
):
    # The README's multi-turn example on the tiny model (issue 56): before, found only in iteration 1's rollout,
    # with "at most 256", which the config refuses (it must be > data.max_prompt_tokens, 256 by default).
    import json as _json

    context = _json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    base = [
        "model.policy_path=" + str(tiny_model_dir),
        "model.apply_chat_template=true",
        "data.path=" + str(digits_dataset_dir),
        "run.root=" + str(tmp_path / "runs"),
        "rollout.environment={source: 'tests.fixtures.digit_env:DigitGuessEnv', max_turns: 4, max_total_tokens: 1024}",
    ]
    (problem,) = static_problems(load_config(None, base))
    assert problem.startswith(
        f"rollout.environment.max_total_tokens=1024 is more than the policy's context of {context} tokens "
        f"(max_position_embeddings of {tiny_model_dir}/config.json)"
    )
    fix = problem.split("Fix: ")[1].replace("--set ", "").split(" ")
    # max_total_tokens = the context; data.max_prompt_tokens (256, not below it) = context - max_new_tokens (16)
    assert fix == [f"rollout.environment.max_total_tokens={context}", f"data.max_prompt_tokens={context - 16}"]
    assert static_problems(load_config(None, base + fix)) == []  # the fix validates and passes the check
    # vLLM's rollout.max_model_len, when smaller, is the context; the prompts' limit under it is kept
    shorter = base + ["rollout.engine=vllm", "rollout.max_model_len=200", "data.max_prompt_tokens=100"]
    (problem,) = static_problems(load_config(None, shorter))
    assert "context of 200 tokens (rollout.max_model_len)" in problem
    assert problem.endswith("Fix: --set rollout.environment.max_total_tokens=200")
    # HF generate ignores rollout.max_model_len: the policy's positions are the context
    (problem,) = static_problems(load_config(None, shorter + ["rollout.engine=hf"]))
    assert "context of 256 tokens (max_position_embeddings" in problem


def test_a_relative_path_not_found_names_the_folder_it_was_resolved_against(tiny_model_dir, tmp_path, monkeypatch):
    # Issue 56: a deployment's run with the minimal JSON config said "'./runs/_data/digits' not found", without
    # the folder (the flow run's, not the user's) that ./ meant.
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["model.policy_path=" + str(tiny_model_dir), "data.path=./runs/_data/digits"])
    (problem,) = [p for p in static_problems(cfg) if p.startswith("data.path:")]
    assert problem.endswith(
        f"not found (data.path: a datasets folder, .jsonl or .parquet) (a relative path, "
        f"resolved against the working folder {tmp_path})"
    ), problem


def test_the_longest_prompt_and_max_new_tokens_are_checked_against_the_context_with_a_fix_that_passes(
    tiny_model_dir, digits_dataset_dir, tmp_path
):
    # Before, the engine refused the prompt in iteration 1's rollout. The fix is a property: N passes, N + 1 not.
    import re

    from flows.preflight import preflight

    base = ["model.policy_path=" + str(tiny_model_dir), "data.path=" + str(digits_dataset_dir)]
    base += ["run.root=" + str(tmp_path / "runs")]
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, base + ["rollout.max_new_tokens=255"]))
    text = str(err.value)
    assert "is more than the policy's context of 256 tokens" in text and f"{digits_dataset_dir} row " in text, text
    room = int(re.search(r"Fix: --set rollout\.max_new_tokens=(\d+)", text).group(1))
    preflight(load_config(None, base + [f"rollout.max_new_tokens={room}"]))
    with pytest.raises(PreflightError, match=f"rollout.max_new_tokens={room + 1}: the longest prompt"):
        preflight(load_config(None, base + [f"rollout.max_new_tokens={room + 1}"]))
