"""adaptations/transformers.py: transformers 5.19 still gives `save_pretrained` no writer of the caller's and
nothing back, and still writes every safetensors file through the module-level name the adaptation swaps.

When `test_upstream_still_takes_no_writer_and_returns_nothing` fails, transformers takes a writer (or returns the
files it wrote): use that and remove the swap. When the others fail, the swap no longer reaches the write.

`gguf_read_once`: transformers still builds a `gguf.GGUFReader` per load of a GGUF file and a tensor-name map per
submodule, through the `gguf` module's names (the upstream test); within the block, one of each.
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


def _tiny_gguf(folder) -> str:
    """A GGUF file of a 2-layer llama's config (no tensors, no vocabulary): what transformers reads for a config and
    for the tensor names. Returns its file name in `folder`."""
    import gguf

    writer = gguf.GGUFWriter(str(folder / "tiny.gguf"), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return "tiny.gguf"


def _count_gguf_reads(monkeypatch) -> dict[str, int]:
    """gguf's reader class and name-map function, counting their calls (swapped in as the names transformers reads)."""
    import gguf

    counts = {"readers": 0, "name_maps": 0}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class CountingReader(reader_class):
        def __init__(self, *args, **kwargs):
            counts["readers"] += 1
            super().__init__(*args, **kwargs)

    def counting_name_map(*args):
        counts["name_maps"] += 1
        return name_map(*args)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_name_map)
    return counts


def _load_twice_and_map(folder, name):
    """Two config loads of the GGUF file, then the GGUF-to-HF weight name map of a model of that config."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    first = AutoConfig.from_pretrained(folder, gguf_file=name)
    second = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = LlamaForCausalLM(first)
    return first.to_dict(), second.to_dict(), get_gguf_hf_weights_map(model, TensorProcessor()), model


def test_upstream_still_parses_the_gguf_file_at_each_load_and_builds_a_name_map_per_submodule(tmp_path, monkeypatch):
    counts = _count_gguf_reads(monkeypatch)
    first, second, names, model = _load_twice_and_map(tmp_path, _tiny_gguf(tmp_path))
    assert first["num_hidden_layers"] == 2 and first["hidden_size"] == 32 and first == second
    assert counts["readers"] == 2  # one parse per load
    assert counts["name_maps"] == len(list(model.modules()))  # one map per submodule, the same map each time
    assert names["blk.1.ffn_down.weight"] == "model.layers.1.mlp.down_proj.weight"


def test_within_gguf_read_once_a_file_is_parsed_once_and_a_name_map_built_once(tmp_path, monkeypatch):
    import gguf

    from adaptations.transformers import gguf_read_once

    name = _tiny_gguf(tmp_path)
    counts = _count_gguf_reads(monkeypatch)
    upstream = _load_twice_and_map(tmp_path, name)[:3]
    counting_reader, counting_map = gguf.GGUFReader, gguf.get_tensor_name_map
    counts.update(readers=0, name_maps=0)
    with gguf_read_once() as swapped:
        adapted = _load_twice_and_map(tmp_path, name)[:3]
    assert swapped and counts == {"readers": 1, "name_maps": 1}
    assert adapted == upstream  # the same configs and the same weight names
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is counting_map  # restored
