"""PromptSource: loading formats, column / length errors, and the (seed, iteration) data order."""

import json

import pytest

from engines.data import PromptSource, epoch_permutation
from engines.models import load_tokenizer
from ppoflow.config import DataConfig


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_loads_saved_dataset_and_tokenises_with_bos(digits_dataset_dir, tokenizer):
    source = PromptSource(DataConfig(path=str(digits_dataset_dir)), tokenizer)
    assert len(source) == 256
    record = source.prompts_for_iteration(0, 1, seed=0)[0]
    # The word-level tokenizer prepends <s> (id 1) to the whitespace-split words of the prompt.
    assert record.prompt_ids[0] == tokenizer.bos_token_id
    assert len(record.prompt_ids) == 1 + len(record.text.split())
    assert record.label == record.text.split()[-2]  # templates end with "<digit> :"


def test_jsonl_and_parquet(tmp_path, tokenizer):
    rows = [{"prompt": "say 3 :", "label": "3"}, {"prompt": "say 4 :", "label": "4"}]
    source = PromptSource(DataConfig(path=str(_write_jsonl(tmp_path / "d.jsonl", rows))), tokenizer)
    assert sorted(r.label for r in source.prompts_for_iteration(0, 2, seed=0)) == ["3", "4"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert len(PromptSource(DataConfig(path=str(tmp_path / "d.parquet")), tokenizer)) == 2


def test_missing_column_names_column_and_columns_present(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "say 3 :", "label": "3"}])
    with pytest.raises(KeyError, match=r"'prompt'.*data.prompt_key.*\['question', 'label'\]"):
        PromptSource(DataConfig(path=str(path)), tokenizer)


def test_missing_file_and_bad_suffix(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptSource(DataConfig(path=str(tmp_path / "nope.jsonl")), tokenizer)
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'"):
        PromptSource(DataConfig(path=str(tmp_path / "d.csv")), tokenizer)


def test_too_long_prompt_names_the_row(tmp_path, tokenizer):
    rows = [{"prompt": "say 3 :", "label": "3"}, {"prompt": "say " * 10 + ":", "label": "1"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    # Row 1 has 1 (BOS) + 11 words = 12 tokens > 8.
    with pytest.raises(ValueError, match=r"row 1: prompt has 12 tokens.*max_prompt_tokens=8"):
        PromptSource(DataConfig(path=str(path), max_prompt_tokens=8), tokenizer)


def test_chat_template_applied_when_asked(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "say 3 :", "label": "3"}])
    source = PromptSource(DataConfig(path=str(path)), tokenizer, apply_chat_template=True)
    # engines/toy/model.py's template: "user : <content> assistant : " (no BOS: the template owns specials).
    assert source.texts[0].split() == ["user", ":", "say", "3", ":", "assistant", ":"]
    assert source.prompt_ids[0][0] != tokenizer.bos_token_id


def test_order_is_a_function_of_seed_and_iteration(digits_dataset_dir, tokenizer):
    source = PromptSource(DataConfig(path=str(digits_dataset_dir)), tokenizer)
    n = len(source)
    # Iterations 0..7 of 32 prompts cover epoch 0 exactly once: a permutation of all 256 rows.
    first_epoch = [i for it in range(8) for i in source.row_indices(it, 32, seed=5)]
    assert sorted(first_epoch) == list(range(n))
    assert first_epoch == epoch_permutation(n, 5, 0)
    # The same call in a "resumed" source gives the same rows; another seed gives another order.
    again = PromptSource(DataConfig(path=str(digits_dataset_dir)), tokenizer)
    assert again.row_indices(3, 32, seed=5) == source.row_indices(3, 32, seed=5)
    assert source.row_indices(3, 32, seed=6) != source.row_indices(3, 32, seed=5)


def test_iteration_spanning_two_epochs(digits_dataset_dir, tokenizer):
    source = PromptSource(DataConfig(path=str(digits_dataset_dir)), tokenizer)
    # count 100: iteration 2 covers stream positions 200..299 = epoch 0 [200:256] + epoch 1 [0:44].
    rows = source.row_indices(2, 100, seed=1)
    assert rows == epoch_permutation(256, 1, 0)[200:] + epoch_permutation(256, 1, 1)[:44]
