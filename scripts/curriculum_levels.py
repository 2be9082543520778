"""How well the initial model does at each level of a run's curriculum: the numbers a recipe's levels are chosen by.

    python scripts/curriculum_levels.py configs/real_arithmetic_curriculum.yaml [--set section.field=value ...]
        [--problems 100] [--levels 0 2 3]

For each level of data.reasoning_gym.curriculum: `--problems` held-out problems of that level (the target level's
are the run's own held-out set), the policy greedy (eval's sampling) and rollout.n_samples samples at the rollout's
temperature, scored by the run's first reward source (a function). Prints one line per level: greedy accuracy,
sampled accuracy, the sampled reward mean (what promote_at is compared with), pass@k and the share of prompts whose
k samples' rewards differ (GRPO's groups with signal). vLLM on the CPU, as the run samples; ~30 s per level for
SmolLM2-135M and 100 problems on 2 cores.
"""

from __future__ import annotations

import argparse
import json


def _prompts(cfg, tokenizer, rows: list[dict]) -> list[str]:
    if not cfg.model.apply_chat_template:
        return [r["prompt"] for r in rows]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]


def _level_rows(cfg, level: int, problems: int) -> list[dict]:
    from engines.curriculum import level_spec
    from engines.reasoning_tasks import generate_rows

    spec = cfg.data.reasoning_gym
    plain = level_spec(spec, level, eval_size=problems).model_copy(update={"size": 1})
    if level == spec.curriculum.target_level:
        plain = plain.model_copy(update={"size": spec.size})  # the run's own held-out set
    return generate_rows(plain)[1]


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from engines.curriculum import level_count
    from engines.rewards.function import load_reward_function
    from engines.rollout.vllm_engine import VLLMSettings, cpu_engine_kwargs
    from ppoflow.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--levels", type=int, nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    spec = cfg.data.reasoning_gym
    if spec is None or spec.curriculum is None:
        raise SystemExit(f"{args.config}: data.reasoning_gym.curriculum is not set")
    score = load_reward_function(cfg.reward.sources[0].target)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.policy_path)
    # the engine's settings (float32, eager, the KV cache bound) and its whole, shared prefills, as in a run
    settings = VLLMSettings(max_model_len=cfg.rollout.max_model_len, kv_cache_space_gib=cfg.rollout.kv_cache_space_gib)
    prefill = cpu_engine_kwargs(cfg.rollout.max_model_len or 2048)
    llm = LLM(cfg.model.policy_path, seed=cfg.run.seed, **settings.llm_kwargs(), **prefill)
    k = cfg.rollout.n_samples
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.eval.max_new_tokens)
    sampled = SamplingParams(n=k, temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_new_tokens, seed=0)
    for level in args.levels if args.levels is not None else range(level_count(spec)):
        rows = _level_rows(cfg, level, args.problems)
        prompts = _prompts(cfg, tokenizer, rows)
        best = llm.generate(prompts, greedy, use_tqdm=False)
        many = llm.generate(prompts, sampled, use_tqdm=False)
        g = [score(r["data_source"], o.outputs[0].text, r["label"]) for r, o in zip(rows, best)]
        s = [[score(r["data_source"], c.text, r["label"]) for c in o.outputs] for r, o in zip(rows, many)]
        n = len(rows)
        line = {
            "level": level,
            "question": json.loads(rows[0]["label"])["question"],
            "greedy": round(sum(x >= 1.0 for x in g) / n, 3),
            "sampled": round(sum(x >= 1.0 for grp in s for x in grp) / (n * k), 3),
            "sampled_reward": round(sum(x for grp in s for x in grp) / (n * k), 3),  # what promote_at compares
            f"pass@{k}": round(sum(any(x >= 1.0 for x in grp) for grp in s) / n, 3),
            "spread": round(sum(len(set(grp)) > 1 for grp in s) / n, 3),
            "example": best[0].outputs[0].text[:60],
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
