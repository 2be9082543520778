"""TRL's RewardTrainer on the toy preference pairs; runs INSIDE bench/.venvs/trl-grpo (trl 1.16, bench/trl_env.py).

    bench/.venvs/trl-grpo/bin/python bench/trl_side/rm_trl.py --model DIR --tokens TOKENS.json --seed 0 \
        --epochs 1 --batch-size 32 --micro-batch-size 32 --lr 1e-3 --warmup-steps 5

The pairs come already tokenized by ppoflow (TOKENS.json: chosen_ids / rejected_ids of the train and eval
pairs, the pad id), passed to RewardTrainer as its pre-tokenized `chosen_ids` / `rejected_ids` columns, so
both sides train on the same token ids. Same model folder (AutoModelForSequenceClassification, num_labels 1,
a new score head), same pairs per optimizer step (per_device_train_batch_size = micro-batch,
gradient_accumulation_steps = batch / micro-batch), epochs, AdamW lr, cosine schedule after linear warm-up,
gradient clipping 1.0, float32 (bfloat16 autocast with --bf16), no gradient checkpointing.
TRL's own choices stay: its random (not length-sorted) batches and its last partial batch.
Eval accuracy is computed here after training by the same rule as ppoflow's (score at the last token,
r_chosen > r_rejected), over the eval pairs.
Prints one {"event": "final", ...} JSON line (bench/trl_side/common.py protocol).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.trl_side.common import drop_console_callbacks, emit_record, one_thread  # noqa: E402


def eval_accuracy(model, pairs: dict, pad_id: int, batch: int = 64) -> float:
    """Share of eval pairs with score(chosen) > score(rejected); the model's own last-non-pad pooling."""
    import torch

    model.eval()
    right = 0
    with torch.no_grad():
        for start in range(0, len(pairs["chosen_ids"]), batch):
            rows = pairs["chosen_ids"][start : start + batch] + pairs["rejected_ids"][start : start + batch]
            width = max(len(r) for r in rows)
            ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
            scores = model(input_ids=ids, attention_mask=(ids != pad_id).long()).logits[:, 0]
            half = len(rows) // 2
            right += int((scores[:half] > scores[half:]).sum())
    return right / len(pairs["chosen_ids"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, kind in (
        ("--model", str),
        ("--tokens", str),
        ("--seed", int),
        ("--epochs", int),
        ("--batch-size", int),
        ("--micro-batch-size", int),
        ("--lr", float),
        ("--warmup-steps", int),
    ):
        p.add_argument(name, type=kind, required=True)
    p.add_argument("--bf16", action="store_true", help="bf16=True: bfloat16 autocast (ppoflow's CPU precision)")
    a = p.parse_args(argv)
    one_thread()
    started = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokens = json.loads(Path(a.tokens).read_text())
    torch.manual_seed(a.seed)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokens["pad_token_id"]
    train = Dataset.from_dict({key: tokens["train"][key] for key in ("chosen_ids", "rejected_ids")})
    with tempfile.TemporaryDirectory(prefix="rm_trl_") as out:
        config = RewardConfig(
            output_dir=out,
            seed=a.seed,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            bf16=a.bf16,
            gradient_checkpointing=False,
            per_device_train_batch_size=a.micro_batch_size,
            gradient_accumulation_steps=a.batch_size // a.micro_batch_size,
            num_train_epochs=a.epochs,
            learning_rate=a.lr,
            lr_scheduler_type="cosine",
            warmup_steps=a.warmup_steps,
            weight_decay=0.0,
            max_grad_norm=1.0,
            max_length=None,
            dataloader_num_workers=0,
        )
        trainer = RewardTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
        drop_console_callbacks(trainer)
        setup_s = time.perf_counter() - started
        train_started = time.perf_counter()
        result = trainer.train()
        train_s = time.perf_counter() - train_started
    steps = int(result.global_step)
    emit_record(
        "final",
        trainer="trl_reward_bf16" if a.bf16 else "trl_reward",
        seed=a.seed,
        steps=steps,
        setup_s=setup_s,
        train_s=train_s,
        step_s=train_s / max(steps, 1),
        train_loss=float(result.training_loss),
        eval_accuracy=eval_accuracy(model, tokens["eval"], tokens["pad_token_id"]),
    )


if __name__ == "__main__":
    main()
