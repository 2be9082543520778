"""TRL 1.12.0's PPOTrainer on the digits task; runs INSIDE bench/.venvs/trl-ppo (see bench/trl_env.py).

    bench/.venvs/trl-ppo/bin/python bench/trl_side/ppo_trl.py --model DIR --seed 0 --iterations 150 --gc frozen

The recipe is the peer benchmark's PPO recipe (bench/peer_trl.py): 64 prompts per iteration, 4 PPO epochs
over one minibatch, AdamW lr 1e-3 constant, no gradient clipping (PPOTrainer's own loop never clips),
k1 KL coefficient 0.05 folded into the reward with the score on the last token, GAE gamma 1 lambda 0.95,
whitened advantages (always on in TRL), clip 0.2, value clip 0.2, vf coef 0.1, a value model made from
the policy backbone plus a new head (AutoModelForSequenceClassification, num_labels=1), a frozen
reference copy of the policy.

The reward is a rule, not a model. TRL calls `get_reward(reward_model, query_responses, pad, context)`,
which runs `getattr(model, model.base_model_prefix)(input_ids=..., attention_mask=..., ...)`, passes
`.hidden_states[-1]` (B, T, H) through `model.score` and reads the score at the last response token.
`DigitsRuleReward` fills that contract: its backbone returns the rule's reward of each row broadcast over
every position, Shape (B, T, 1), and `score` is the identity, so whichever position TRL reads, it gets
the digits reward of the decoded response.

Stop tokens: the tokenizer's pad (id 0) differs from EOS (id 2). stop_token="eos" makes TRL truncate
after the first EOS; TRL also treats the first *sampled* pad as the end of a response (its sequence length
is the first pad). The rule therefore scores only the words before the first EOS or pad, and the ppoflow
side stops sampling at both, so the two sides score the same responses.

--gc shipped runs TRL as it is (two gc.collect() per iteration); --gc frozen calls gc.freeze() first, so
those collections skip the long-lived objects (models, tensors, modules): the peer number.

--precision fp32 (default) loads the three models in float32 with SDPA attention, as TRL runs out of the
box on CPU. --precision bf16 sets PPOConfig(bf16=True) (accelerate's bfloat16 autocast; weights and AdamW
stay float32) and eager attention: the settings ppoflow's side runs with, for the ratio at equal precision.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

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

PROMPTS_PER_ITERATION = 64
RESPONSE_LENGTH = 8
# TRL's logged metrics carried into each iteration record, to see why a run learns or does not
DIAGNOSTICS = {
    "kl": "objective/kl",
    "entropy": "objective/entropy",
    "clipfrac": "policy/clipfrac_avg",
    "approxkl": "policy/approxkl_avg",
    "ratio": "val/ratio",
    "value_loss": "loss/value_avg",
}


def _rule_backbone_class():
    import torch

    class DigitsRuleBackbone(torch.nn.Module):
        """Computes the digits reward of each row of (left-padded prompt + response) token ids.

        The prompt of a row is found by its token ids (a lookup built from the training prompts); the
        response is what follows it up to the first unattended position (TRL masks pads) or EOS.
        Raises ValueError naming the row when no known prompt starts it.
        """

        def __init__(self, tokenizer, prompts: list[str], labels: list[str]) -> None:
            super().__init__()
            self.tokenizer = tokenizer
            self.label_by_prompt = {tuple(tokenizer(p)["input_ids"]): lab for p, lab in zip(prompts, labels)}
            self.prompt_lengths = sorted({len(k) for k in self.label_by_prompt})
            self.end_ids = (tokenizer.eos_token_id, tokenizer.pad_token_id)

        def row_reward(self, ids: list[int], row: int) -> float:
            for length in self.prompt_lengths:
                label = self.label_by_prompt.get(tuple(ids[:length]))
                if label is not None:
                    return response_reward(ids[length:], label, self.tokenizer, self.end_ids)
            raise ValueError(f"reward rule: row {row} does not start with a known prompt: {ids[:12]}")

        def forward(self, input_ids, attention_mask, **_):
            pad = self.tokenizer.pad_token_id
            rows = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, pad))
            rewards = []
            for b, mask in enumerate(attention_mask.bool()):
                start = int(mask.float().argmax())  # first attended token: the prompt's BOS
                rewards.append(self.row_reward(rows[b, start:].tolist(), b))
            per_row = torch.tensor(rewards, dtype=torch.float32, device=input_ids.device)
            hidden = per_row[:, None, None].expand(-1, input_ids.shape[1], 1)
            return SimpleNamespace(hidden_states=[hidden])

    class DigitsRuleReward(torch.nn.Module):
        """The object TRL's PPOTrainer takes as `reward_model` (see the module docstring)."""

        base_model_prefix = "rule"

        def __init__(self, tokenizer, prompts: list[str], labels: list[str]) -> None:
            super().__init__()
            self.rule = DigitsRuleBackbone(tokenizer, prompts, labels)
            self.score = torch.nn.Identity()

    return DigitsRuleReward


def build_trainer(
    model_dir: str,
    seed: int,
    iterations: int,
    output_dir: str,
    stopwatch: Stopwatch,
    records: list,
    precision: str = "fp32",
):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    load_kwargs = {"attn_implementation": "eager" if precision == "bf16" else "sdpa", "dtype": torch.float32}
    policy = AutoModelForCausalLM.from_pretrained(model_dir, **load_kwargs)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, **load_kwargs)
    value = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, **load_kwargs)
    value.config.pad_token_id = tokenizer.pad_token_id
    rows = make_rows(DATASET_ROWS, DATASET_SEED)
    train = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in rows["prompt"]]})
    config = PPOConfig(
        output_dir=output_dir,
        seed=seed,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        num_sample_generations=0,
        per_device_train_batch_size=PROMPTS_PER_ITERATION,
        gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=PROMPTS_PER_ITERATION,
        num_mini_batches=1,
        num_ppo_epochs=4,
        total_episodes=PROMPTS_PER_ITERATION * iterations,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        response_length=RESPONSE_LENGTH,
        temperature=1.0,
        stop_token="eos",
        missing_eos_penalty=None,
        kl_coef=0.05,
        kl_estimator="k1",
        gamma=1.0,
        lam=0.95,
        whiten_rewards=False,
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        bf16=precision == "bf16",
    )
    reward = _rule_backbone_class()(tokenizer, rows["prompt"], rows["label"])
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=reward,
        train_dataset=train,
        value_model=value,
        eval_dataset=train.select(range(PROMPTS_PER_ITERATION)),
        callbacks=[progress_callback(stopwatch, records, "objective/scores", DIAGNOSTICS)],
    )
    drop_console_callbacks(trainer)
    return trainer, tokenizer, policy


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face folder of the shared policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--gc", choices=["shipped", "frozen"], default="frozen")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--greedy-eval", action="store_true", help="greedy accuracy on held-out prompts at the end")
    a = p.parse_args(argv)
    one_thread()
    process_start = time.perf_counter()
    stopwatch, records = Stopwatch(), []
    with tempfile.TemporaryDirectory(prefix="ppo_trl_") as output_dir:
        trainer, tokenizer, policy = build_trainer(
            a.model, a.seed, a.iterations, output_dir, stopwatch, records, a.precision
        )
        if a.gc == "frozen":
            gc.collect()
            gc.freeze()  # what exists now (models, data) is never scanned again by TRL's gc.collect()
        setup_s = time.perf_counter() - process_start
        train_start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - train_start
    greedy = greedy_eval(policy, tokenizer) if a.greedy_eval else (None, None)
    emit_final("trl_ppo", a.seed, records, setup_s, train_s, greedy, gc=a.gc, precision=a.precision)


if __name__ == "__main__":
    main()
