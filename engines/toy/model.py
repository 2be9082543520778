"""Build a tiny Llama-style policy and a word-level tokenizer locally, saved with save_pretrained.

The result is an ordinary Hugging Face folder: the trainer, the reference, vLLM and TRL all load it with
`from_pretrained(path)`, the same code path a real model takes.

head_dim is 64 because vLLM's CPU attention rejects smaller heads (shared/ENVIRONMENT.md).

    python -m engines.toy.model ./runs/_models/tiny-llama
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from engines.toy.cli import toy_main

DIGITS = [str(d) for d in range(10)]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ["repeat", "say", "digit", "write", "copy", "the", "number", ":", "please", "now"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def build_vocab(size: int = 64) -> list[str]:
    base = SPECIAL + DIGITS + WORDS + ["user", "assistant", "system"]
    if size < len(base):
        raise ValueError(f"vocab size {size} is below the {len(base)} tokens the toy tasks need")
    return base + [f"w{i}" for i in range(size - len(base))]


def build_tokenizer(vocab_size: int = 64):
    """A word-level PreTrainedTokenizerFast: whitespace-split words, BOS prepended, pad != eos.

    Pad is its own token, never EOS, so a trainer that treats pad as end-of-response (TRL) and one
    that does not see the same responses.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(build_vocab(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass(frozen=True)
class ToyShape:
    """The sizes of a toy Llama (policy or reward model); keyword arguments of the builders below."""

    vocab_size: int = 64
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 256

    def llama_sizes(self) -> dict[str, int]:
        """The sizes under LlamaConfig's names, with one key/value head per head (no grouped-query attention)."""
        renamed = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"}
        sizes = {renamed.get(field, field): value for field, value in asdict(self).items()}
        return {**sizes, "num_key_value_heads": self.num_heads}


def build_toy_model(model_class, out_dir: str | Path, shape: ToyShape, seed: int, **head) -> Path:
    """`model_class` (a transformers Llama class) randomly initialised under `seed` with the toy tokenizer's
    vocabulary and special ids, float32, saved with that tokenizer to `out_dir`; returns the folder.

    `head` adds the settings of the model's head to its LlamaConfig (tie_word_embeddings, num_labels).
    """
    import torch
    from transformers import LlamaConfig

    tokenizer = build_tokenizer(shape.vocab_size)
    special_ids = {key: getattr(tokenizer, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(**shape.llama_sizes(), **special_ids, torch_dtype="float32", **head)
    torch.manual_seed(seed)
    return save_model_folder(model_class(config), tokenizer, out_dir)


def build_tiny_llama(out_dir: str | Path, seed: int = 0, **shape) -> Path:
    """Random-init LlamaForCausalLM + tokenizer saved to `out_dir`; returns the folder. `shape`: ToyShape's
    fields (hidden_size=256, num_heads=4, ...).

    Raises ValueError when hidden_size / num_heads is not 64 (vLLM CPU needs head_dim 64), TypeError for a
    keyword that is not a ToyShape field.
    """
    from transformers import LlamaForCausalLM

    sizes = ToyShape(**shape)
    if sizes.hidden_size % sizes.num_heads or sizes.hidden_size // sizes.num_heads != 64:
        raise ValueError(f"head_dim = hidden_size/num_heads must be 64, got {sizes.hidden_size}/{sizes.num_heads}")
    return build_toy_model(LlamaForCausalLM, out_dir, sizes, seed, tie_word_embeddings=False)


def save_model_folder(model, tokenizer, out_dir: str | Path) -> Path:
    """save_pretrained (safetensors) of model and tokenizer into `out_dir`, created if missing."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)
    return out


def ensure_tiny_llama(out_dir: str | Path, **kwargs) -> Path:
    """Build the tiny model unless `out_dir` already holds one (config.json and weights)."""
    from engines.toy.task import built_once

    return built_once(Path(out_dir), ("config.json", "model.safetensors"), lambda out: build_tiny_llama(out, **kwargs))


def main(argv: list[str] | None = None) -> None:
    options = {  # flag -> ToyShape field (or the seed)
        "--vocab-size": "vocab_size",
        "--hidden-size": "hidden_size",
        "--layers": "num_layers",
        "--heads": "num_heads",
        "--intermediate-size": "intermediate_size",
        "--seed": "seed",
    }
    toy_main(__doc__, build_tiny_llama, options, argv)


if __name__ == "__main__":
    main()
