"""Build a tiny Llama-style policy and a word-level tokenizer locally, saved with save_pretrained.

The result is an ordinary Hugging Face folder: the trainer, the reference, vLLM and TRL all load it with
`from_pretrained(path)`, the same code path a real model takes.

head_dim is 64 because vLLM's CPU attention rejects smaller heads (shared/ENVIRONMENT.md).

    python -m engines.toy.model ./runs/_models/tiny-llama
"""

from __future__ import annotations

import argparse
from pathlib import Path

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


def toy_llama_config(
    tokenizer,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    **extra,
):
    """The LlamaConfig of the toy models (policy and reward model): the toy tokenizer's vocabulary and special
    ids, one key/value head per head, float32; `extra` adds the head-specific settings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **extra,
    )


def build_tiny_llama(
    out_dir: str | Path,
    vocab_size: int = 64,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> Path:
    """Random-init LlamaForCausalLM + tokenizer saved to `out_dir`; returns the folder.

    Raises ValueError when hidden_size / num_heads is not 64 (vLLM CPU needs head_dim 64).
    """
    import torch
    from transformers import LlamaForCausalLM

    if hidden_size % num_heads or hidden_size // num_heads != 64:
        raise ValueError(f"head_dim = hidden_size/num_heads must be 64, got {hidden_size}/{num_heads}")
    tokenizer = build_tokenizer(vocab_size)
    config = toy_llama_config(
        tokenizer,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        intermediate_size,
        max_position_embeddings,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    out = save_model_folder(LlamaForCausalLM(config), tokenizer, out_dir)
    return out


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=256)
    a = p.parse_args(argv)
    path = build_tiny_llama(a.out_dir, a.vocab_size, a.hidden_size, a.layers, a.heads, a.intermediate_size)
    print(path)


if __name__ == "__main__":
    main()
