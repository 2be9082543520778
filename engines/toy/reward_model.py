"""Build a tiny Llama reward model (sequence classification, one label) locally, saved with save_pretrained.

It shares the toy tokenizer (engines/toy/model.py), so the digits task's texts tokenize without unknown
words, and it loads with `AutoModelForSequenceClassification.from_pretrained(path)` like a real reward
model. The weights are random: its scores are arbitrary but deterministic for a seed.

    python -m engines.toy.reward_model ./runs/_models/tiny-rm
"""

from __future__ import annotations

from pathlib import Path

from engines.toy.cli import toy_main
from engines.toy.model import ToyShape, build_toy_model


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0, num_labels: int = 1, **shape) -> Path:
    """Random-init LlamaForSequenceClassification + the toy tokenizer saved to `out_dir`; returns it.
    `shape`: ToyShape's fields (engines/toy/model.py); TypeError for a keyword that is not one.

    `num_labels` other than 1 exists only so tests can build a model that is not a reward model.
    pad_token_id is set in the config: the classifier pools at the last non-pad token and needs it.
    """
    from transformers import LlamaForSequenceClassification

    return build_toy_model(LlamaForSequenceClassification, out_dir, ToyShape(**shape), seed, num_labels=num_labels)


def main(argv: list[str] | None = None) -> None:
    toy_main(__doc__, build_tiny_reward_model, {"--seed": "seed"}, argv)


if __name__ == "__main__":
    main()
