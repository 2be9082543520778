"""adaptations/transformers.py: transformers 5.19 still gives `save_pretrained` no writer of the caller's and
nothing back, and still writes every safetensors file through the module-level name the adaptation swaps.

When `test_upstream_still_takes_no_writer_and_returns_nothing` fails, transformers takes a writer (or returns the
files it wrote): use that and remove the swap. When the others fail, the swap no longer reaches the write.
"""

from __future__ import annotations

import inspect
import threading

import torch
import transformers.modeling_utils as hf_modeling
from safetensors.torch import save_file as SAFETENSORS_SAVE_FILE
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from adaptations.transformers import safetensors_writer


def _llama():
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, num_key_value_heads=2, **shape))


def test_upstream_still_takes_no_writer_and_returns_nothing(tmp_path):
    parameters = set(inspect.signature(PreTrainedModel.save_pretrained).parameters)
    assert not parameters & {"save_function", "safe_save_function", "writer", "save_file"}, parameters
    assert _llama().save_pretrained(tmp_path / "m", safe_serialization=True) is None
    assert hf_modeling.safe_save_file is SAFETENSORS_SAVE_FILE  # the name the swap replaces, still safetensors'


def test_every_file_of_a_sharded_save_goes_through_the_swapped_writer_then_the_name_is_restored(tmp_path):
    written = []

    def write(tensors, filename, metadata=None):
        written.append(filename.rsplit("/", 1)[-1])
        SAFETENSORS_SAVE_FILE(tensors, filename, metadata=metadata)

    with safetensors_writer(write) as swapped:
        _llama().save_pretrained(tmp_path / "m", safe_serialization=True, max_shard_size="100KB")
    on_disk = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert swapped and len(on_disk) > 1 and sorted(written) == on_disk
    assert hf_modeling.safe_save_file is SAFETENSORS_SAVE_FILE


def test_another_thread_saving_meanwhile_gets_safetensors_own_writer(tmp_path):
    # The other thread's save runs while this thread holds the swap: it must not go through `write`.
    written, other_done = [], threading.Event()

    def other_save():
        _llama().save_pretrained(tmp_path / "other", safe_serialization=True)
        other_done.set()

    with safetensors_writer(lambda tensors, filename, metadata=None: written.append(filename)):
        thread = threading.Thread(target=other_save)
        thread.start()
        thread.join(timeout=120)
    assert other_done.is_set() and written == []
    assert (tmp_path / "other" / "model.safetensors").is_file()
