"""What every trainer of the peer benchmark shares: prompts, the digits rule on token ids, progress lines, greedy eval.

This module runs INSIDE TRL's own venvs (bench/.venvs/trl-*) as well as in ppoflow's, so it imports only
torch, transformers and engines.toy.task (stdlib-only at import). Scripts put the repository root on
sys.path themselves.

Progress protocol (read by bench/peer_trl.py): every JSON line a trainer prints to stdout that is a dict
with an "event" key is a record; everything else (library logs) is ignored.
    {"event": "iteration", "iteration": k (1-based), "reward_mean": float, "wall_s": s since train start,
     "iter_s": s of this iteration, "cpu_s": this process's CPU s since train start}
    {"event": "final", "iterations": n, "setup_s": s before training, "train_s": s in training,
     "iter_s_mean": float, "reward_last": float, "greedy_reward": float|None, "greedy_exact": float|None}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from engines.toy.task import TARGET_LENGTH, digit_reward, make_rows  # noqa: E402

DATASET_ROWS, DATASET_SEED = 512, 0  # the training prompts, the same on every side
EVAL_ROWS, EVAL_SEED = 64, 12345  # held-out prompts for the greedy accuracy at the end


def one_thread() -> None:
    """One CPU thread per process, so alternating runs compare single-thread compute."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def emit_record(event: str, **fields: Any) -> dict:
    record = {"event": event, **fields}
    print(json.dumps(record), flush=True)
    return record


def emit_final(
    trainer: str,
    seed: int,
    records: list,
    setup_s: float,
    train_s: float,
    greedy: tuple[Any, Any] = (None, None),
    **extra: Any,
) -> dict:
    """The closing record every side prints: timings, the last iteration's reward, the greedy evaluation."""
    return emit_record(
        "final",
        trainer=trainer,
        **extra,
        seed=seed,
        iterations=len(records),
        setup_s=setup_s,
        train_s=train_s,
        iter_s_mean=train_s / max(len(records), 1),
        reward_last=records[-1]["reward_mean"] if records else None,
        greedy_reward=greedy[0],
        greedy_exact=greedy[1],
    )


def drop_console_callbacks(trainer) -> None:
    """Remove the Trainer's printing and tqdm callbacks: stdout carries only this protocol's JSON records."""
    from transformers import PrinterCallback, ProgressCallback

    for noisy in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(noisy)


def response_reward(response_ids: Sequence[int], label: str, tokenizer, end_ids: Sequence[int]) -> float:
    """The digits reward of one response given as token ids, ended at the first id in `end_ids`.

    Ending at pad as well as EOS mirrors TRL, which takes the first pad as the end of a response; the
    words after it are not part of the response on either side (ppoflow stops its sampler at pad too).
    The text is decoded without special tokens and scored by engines.toy.task.digit_reward, so the value
    is the one the ppoflow side computes on its decoded text.
    """
    ids = list(response_ids)
    for position, token in enumerate(ids):
        if token in end_ids:
            ids = ids[:position]
            break
    return digit_reward(tokenizer.decode(ids, skip_special_tokens=True), label)


class Stopwatch:
    """Per-iteration timing: `lap()` returns (seconds since start, seconds since the previous lap).

    `cpu_s()` is this process's CPU seconds since `restart()`: on a machine shared with other work it
    estimates what the wall time would be alone (one thread). It misses helper processes (vLLM's engine
    core, a Prefect server), so it is a load check for TRL, not a fair figure for ppoflow's pipeline.
    """

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.start = self.last = time.perf_counter()
        self.cpu_start = time.process_time()

    def lap(self, at: float | None = None) -> tuple[float, float]:
        """`at`: when the iteration ended, on time.perf_counter's clock, if known better than "now"."""
        now = time.perf_counter() if at is None else at
        since_start, since_last = now - self.start, now - self.last
        self.last = now
        return since_start, since_last

    def cpu_s(self) -> float:
        return time.process_time() - self.cpu_start


def greedy_eval(model, tokenizer, max_new_tokens: int = TARGET_LENGTH) -> tuple[float, float]:
    """Greedy responses to the held-out prompts: (mean digits reward, share with reward 1.0).

    Runs HF generate with do_sample=False, stopping at EOS and at pad (see `response_reward`).
    """
    import torch

    rows = make_rows(EVAL_ROWS, EVAL_SEED)
    tokenizer.padding_side = "left"
    batch = tokenizer(rows["prompt"], return_tensors="pt", padding=True)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    model.train(was_training)
    end_ids = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    responses = out[:, batch["input_ids"].shape[1] :].tolist()
    rewards = [response_reward(r, label, tokenizer, end_ids) for r, label in zip(responses, rows["label"])]
    return sum(rewards) / len(rewards), sum(1 for r in rewards if r == 1.0) / len(rewards)


def progress_callback(stopwatch: "Stopwatch", records: list, reward_key: str, extra_keys: dict | None = None):
    """A transformers TrainerCallback that records one "iteration" line whenever TRL logs `reward_key`
    (its mean reward of the iteration), with wall/iteration/CPU seconds and `extra_keys` (name -> log key)."""
    from transformers import TrainerCallback

    class ProgressLines(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stopwatch.restart()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and reward_key in logs:
                wall_s, iter_s = stopwatch.lap()
                extras = {name: logs.get(key) for name, key in (extra_keys or {}).items()}
                records.append(
                    emit_record(
                        "iteration",
                        iteration=state.global_step,
                        reward_mean=logs[reward_key],
                        wall_s=wall_s,
                        iter_s=iter_s,
                        cpu_s=stopwatch.cpu_s(),
                        **extras,
                    )
                )

    return ProgressLines()
