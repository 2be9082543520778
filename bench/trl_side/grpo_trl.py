"""The current trl's GRPOTrainer on the digits task; runs INSIDE bench/.venvs/trl-grpo (see bench/trl_env.py).

    bench/.venvs/trl-grpo/bin/python bench/trl_side/grpo_trl.py --model DIR --seed 0 --iterations 150

One iteration = one generation batch of 8 prompts x 8 samples (per_device_train_batch_size 64 completions,
num_generations 8, steps_per_generation 1) followed by one optimizer step over it (num_iterations 1,
TRL's default and DeepSeekMath's mu = 1). HF generate (use_vllm=False), temperature 1, 8 new tokens.
AdamW lr 1e-3 constant, no gradient clipping (max_grad_norm 0), KL beta 0.05 (TRL's k3 in the loss),
clip epsilon 0.2; TRL's defaults for the loss aggregation and reward scaling. GRPOConfig's own defaults
that would tilt the timing are undone: gradient_checkpointing False and bf16 False (float32 on both sides).

The reward is the digits rule on the completion's token ids (bench/trl_side/common.response_reward, the
same values as engines.toy.task.digit_reward on the decoded text), given the `label` column.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.trl_side.common import (
    DATASET_ROWS,
    DATASET_SEED,
    Stopwatch,
    drop_console_callbacks,
    emit_final,
    greedy_eval,  # noqa: E402
    make_rows,
    one_thread,
    progress_callback,
    response_reward,
)

PROMPTS_PER_ITERATION, SAMPLES_PER_PROMPT, RESPONSE_LENGTH = 8, 8, 8


def digits_reward_func(tokenizer):
    end_ids = (tokenizer.eos_token_id, tokenizer.pad_token_id)

    def digits(prompts, completions, completion_ids, label, **_):
        """GRPOTrainer reward contract: one float per completion; `label` comes from the dataset column."""
        return [response_reward(ids, lab, tokenizer, end_ids) for ids, lab in zip(completion_ids, label)]

    return digits


def build_trainer(model_dir: str, seed: int, iterations: int, output_dir: str, stopwatch: Stopwatch, records: list):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = make_rows(DATASET_ROWS, DATASET_SEED)
    train = Dataset.from_dict({"prompt": rows["prompt"], "label": rows["label"]})
    config = GRPOConfig(
        output_dir=output_dir,
        seed=seed,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        per_device_train_batch_size=PROMPTS_PER_ITERATION * SAMPLES_PER_PROMPT,
        num_generations=SAMPLES_PER_PROMPT,
        steps_per_generation=1,
        num_iterations=1,
        gradient_accumulation_steps=1,
        max_steps=iterations,
        max_completion_length=RESPONSE_LENGTH,
        temperature=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        beta=0.05,
        epsilon=0.2,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=digits_reward_func(tokenizer),
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[progress_callback(stopwatch, records, "reward", None)],
    )
    drop_console_callbacks(trainer)
    return trainer, tokenizer, policy


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--greedy-eval", action="store_true")
    a = p.parse_args(argv)
    one_thread()
    process_start = time.perf_counter()
    stopwatch, records = Stopwatch(), []
    with tempfile.TemporaryDirectory(prefix="grpo_trl_") as output_dir:
        trainer, tokenizer, policy = build_trainer(a.model, a.seed, a.iterations, output_dir, stopwatch, records)
        setup_s = time.perf_counter() - process_start
        train_start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - train_start
    greedy = greedy_eval(policy, tokenizer) if a.greedy_eval else (None, None)
    emit_final("trl_grpo", a.seed, records, setup_s, train_s, greedy)


if __name__ == "__main__":
    main()
