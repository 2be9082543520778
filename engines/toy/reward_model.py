"""Build a tiny Llama reward model (sequence classification, one label) locally, saved with save_pretrained.

It shares the toy tokenizer (engines/toy/model.py), so the digits task's texts tokenize without unknown
words, and it loads with `AutoModelForSequenceClassification.from_pretrained(path)` like a real reward
model. The weights are random: its scores are arbitrary but deterministic for a seed.

    python -m engines.toy.reward_model ./runs/_models/tiny-rm
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engines.toy.model import build_tokenizer, save_model_folder, toy_llama_config


def build_tiny_reward_model(
    out_dir: str | Path,
    seed: int = 0,
    vocab_size: int = 64,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    num_labels: int = 1,
) -> Path:
    """Random-init LlamaForSequenceClassification + the toy tokenizer saved to `out_dir`; returns it.

    `num_labels` other than 1 exists only so tests can build a model that is not a reward model.
    pad_token_id is set in the config: the classifier pools at the last non-pad token and needs it.
    """
    import torch
    from transformers import LlamaForSequenceClassification

    tokenizer = build_tokenizer(vocab_size)
    config = toy_llama_config(
        tokenizer,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        intermediate_size,
        max_position_embeddings,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    return save_model_folder(LlamaForSequenceClassification(config), tokenizer, out_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build_tiny_reward_model(a.out_dir, seed=a.seed))


if __name__ == "__main__":
    main()
