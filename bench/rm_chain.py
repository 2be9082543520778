"""The reward-model chain on the digits toy task: does PPO on a LEARNED reward model learn the rule?

    python -m bench.rm_chain [--iterations 40] [--pairs 8000] [--epochs 4] [--seeds 0,1,2]

One run, one process, the engine code without Prefect or storage (as bench/learning.py):
1. the toy preference pairs (engines/toy/preferences.py) and a held-out set drawn with another seed;
2. a reward model trained on them (engines/rm/in_process.py: the rm-training flow's engine code; configs/demo_rm.yaml's
   rm_train settings);
3. for each seed, PPO on the rule itself (the baseline) and PPO with the learned model as the only reward
   source: the same recipe (bench/learning.py's, with the chat template), seed and number of iterations; the
   rule's reward of each iteration's rollouts is measured on both (engines/toy/task.digit_reward). Several
   seeds because one 40-iteration run's final figure moves by +-0.05 with the seed (rule: 0.50, 0.44, 0.42
   for seeds 0, 1, 2 here);
4. the reward model's accuracy on its held-out pairs, and on POLICY-SAMPLE pairs: two samples of one prompt
   with different rule rewards, from the baseline run's rollouts (all iterations, and iterations 0-4 alone:
   the random-init policy); the correlation of model score and rule reward over the model-run's rollouts.

Figures: rule_reward_rm / rule_reward_rule = mean rule reward of the last 5 iterations of each run (one
iteration's 128 samples are noisy), averaged over the seeds, their ratio (goal >= 0.8), the first iteration's rule
reward, the accuracies and correlation (mean over seeds), and each seed's figures; one JSON line appended to
bench/results/rm_chain.jsonl. OMP_NUM_THREADS=1 is set (see bench/learning.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.common import emit  # noqa: E402
from bench.learning import RECIPE  # noqa: E402

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo_rm.yaml"
LAST = 5  # iterations averaged for the final figures


def train_rm(work: Path, model_dir: Path, pairs: int, epochs: int, seed: int) -> tuple[Path, dict]:
    """Toy pairs (train: seed, eval: seed + 1000) -> reward model folder under work/ and its metrics."""
    from engines.rm.in_process import train_reward_model
    from engines.toy.preferences import build_preferences
    from ppoflow.config import load_config

    train = build_preferences(work / "pairs-train.jsonl", pairs, seed)
    held_out = build_preferences(work / "pairs-eval.jsonl", max(pairs // 10, 100), seed + 1000)
    cfg = load_config(
        str(DEMO_CONFIG),
        [
            f"model.policy_path={model_dir}",
            f"rm_train.data_path={train}",
            f"rm_train.eval_path={held_out}",
            f"rm_train.epochs={epochs}",
            f"run.seed={seed}",
            f"run.root={work / 'runs'}",
        ],
    )
    out = work / "reward_model"
    return out, train_reward_model(cfg, out)


def ppo_run(work: Path, model_dir: Path, data_dir: Path, iterations: int, seed: int, rm_dir: Path | None) -> list[dict]:
    """PPO for `iterations` (the rule as reward, or rm_dir's model alone) -> every rollout row with its rule reward."""
    from engines.toy.task import digit_reward
    from ppoflow.config import load_config
    from stages.loop import EngineLoop, sync_policy
    from stages.rollout import sample_rollout
    from stages.score import score_rows
    from stages.update import train_on

    settings = [f"{k}={v}" for k, v in RECIPE.items()] + [
        f"model.policy_path={model_dir}",
        f"data.path={data_dir}",
        f"run.iterations={iterations}",
        f"run.seed={seed}",
        "data.data_source_key=data_source",
        "rollout.engine=hf",
        "model.apply_chat_template=true",
        "algo.name=ppo",
    ]
    if rm_dir is not None:
        settings.append(f"reward.sources=[{{kind: model, target: {rm_dir}}}]")
    cfg = load_config(None, settings)
    loop = EngineLoop(cfg, work_dir=str(work / ("loop-rm" if rm_dir else "loop-rule")))
    rows = []
    try:
        for it in range(iterations):
            rollout = sample_rollout(loop.engine, loop.prompt_source, cfg, it)
            scored, _ = score_rows(loop.scorer, rollout, cache=None)
            train_on(loop.trainer, scored)
            sync_policy(loop.trainer, loop.engine, loop.work_dir / "policy", it + 1)
            t = scored.select(["prompt_index", "prompt", "response", "label", "reward"]).to_pydict()
            for i in range(scored.num_rows):
                rule = digit_reward(t["response"][i], t["label"][i])
                rows.append(
                    {k: t[k][i] for k in t} | {"iteration": it, "group": (it, t["prompt_index"][i]), "rule": rule}
                )
            mean = sum(r["rule"] for r in rows[-scored.num_rows :]) / scored.num_rows
            print(f"{'rm' if rm_dir else 'rule'} iteration {it}: rule reward {mean:.3f}", file=sys.stderr, flush=True)
    finally:
        loop.shutdown()
    return rows


def mean_rule(rows: list[dict], iterations: range) -> float:
    picked = [r["rule"] for r in rows if r["iteration"] in iterations]
    return sum(picked) / len(picked)


def policy_pair_accuracy(source, rows: list[dict]) -> tuple[float, int]:
    """(accuracy, pairs) of `source` (a RewardModelSource) on rule_pairs of the rollout rows."""
    from engines.rewards.base import RewardBatch
    from engines.rm.policy_pairs import pair_accuracy, rule_pairs
    from engines.toy.task import digit_reward

    pairs = rule_pairs(rows, digit_reward)
    texts = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    n = len(texts)
    scores = source.score(RewardBatch(texts, [""] * n, [[]] * n, [[]] * n, [None] * n))
    return pair_accuracy(scores[: len(pairs)], scores[len(pairs) :]), len(pairs)


def run(iterations: int, pairs: int, epochs: int, seeds: list[int], work_dir: str | None) -> dict:
    """One reward model (seed seeds[0]); for each PPO seed a run on the rule and one on the model -> figures."""
    from engines.rewards.model import RewardModelSource
    from engines.toy.model import ensure_tiny_llama
    from engines.toy.task import ensure_digits_dataset

    work = Path(work_dir or tempfile.mkdtemp(prefix="ppoflow-bench-rm-chain-"))
    started = time.perf_counter()
    model_dir = ensure_tiny_llama(work / "tiny-llama", seed=0)
    data_dir = ensure_digits_dataset(work / "digits", num_rows=512, seed=0)
    rm_dir, rm_metrics = train_rm(work, model_dir, pairs, epochs, seeds[0])
    rm_seconds = time.perf_counter() - started
    source = RewardModelSource(rm_dir)
    last = range(iterations - LAST, iterations)
    per_seed = []
    for seed in seeds:
        rule_rows = ppo_run(work, model_dir, data_dir, iterations, seed, None)
        rm_rows = ppo_run(work, model_dir, data_dir, iterations, seed, rm_dir)
        per_seed.append(seed_figures(source, rule_rows, rm_rows, last) | {"seed": seed})
    on_rm = sum(f["rule_reward_rm"] for f in per_seed) / len(per_seed)
    on_rule = sum(f["rule_reward_rule"] for f in per_seed) / len(per_seed)
    mean = lambda key: round(sum(f[key] for f in per_seed) / len(per_seed), 4)  # noqa: E731
    figures = {
        "iterations": iterations,
        "seeds": seeds,
        "rule_reward_rm": round(on_rm, 4),
        "rule_reward_rule": round(on_rule, 4),
        "ratio": round(on_rm / on_rule, 3) if on_rule > 0 else None,
        "first_rule_reward_rm": mean("first_rule_reward_rm"),
        "first_rule_reward_rule": mean("first_rule_reward_rule"),
        "rm_eval_accuracy": round(rm_metrics["rm/eval_accuracy"], 4),
        "rm_eval_pairs": rm_metrics["rm/eval_pairs"],
        "rm_policy_pair_accuracy": mean("rm_policy_pair_accuracy"),
        "rm_initial_policy_pair_accuracy": mean("rm_initial_policy_pair_accuracy"),
        "rm_rule_correlation_on_rm_run": mean("rm_rule_correlation_on_rm_run"),
        "per_seed": per_seed,
        "train_pairs": pairs,
        "rm_epochs": epochs,
        "rm_seconds": round(rm_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "final": f"mean rule reward of the last {LAST} iterations, averaged over the seeds",
    }
    print(f"work folder: {work}", file=sys.stderr)
    return emit("rm_chain", figures)


def seed_figures(source, rule_rows: list[dict], rm_rows: list[dict], last: range) -> dict:
    """One seed's figures: final rule rewards of both runs and the model's accuracy / correlation on their samples."""
    from engines.rewards.base import RewardBatch
    from engines.rm.policy_pairs import pearson

    acc_all, n_all = policy_pair_accuracy(source, rule_rows)
    acc_init, n_init = policy_pair_accuracy(source, [r for r in rule_rows if r["iteration"] < 5])
    n = len(rm_rows)
    prompts, responses = [r["prompt"] for r in rm_rows], [r["response"] for r in rm_rows]
    batch = RewardBatch(prompts, responses, [[]] * n, [[]] * n, [None] * n)
    on_rm, on_rule = mean_rule(rm_rows, last), mean_rule(rule_rows, last)
    return {
        "rule_reward_rm": round(on_rm, 4),
        "rule_reward_rule": round(on_rule, 4),
        "ratio": round(on_rm / on_rule, 3) if on_rule > 0 else None,
        "first_rule_reward_rm": round(mean_rule(rm_rows, range(1)), 4),
        "first_rule_reward_rule": round(mean_rule(rule_rows, range(1)), 4),
        "rm_policy_pair_accuracy": round(acc_all, 4),
        "rm_policy_pairs": n_all,
        "rm_initial_policy_pair_accuracy": round(acc_init, 4),
        "rm_initial_policy_pairs": n_init,
        "rm_rule_correlation_on_rm_run": round(pearson(source.score(batch), [r["rule"] for r in rm_rows]), 4),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=40, help="PPO iterations of each run (the LR schedule's length)")
    p.add_argument("--pairs", type=int, default=8000, help="training pairs (held-out: a tenth, another seed)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seeds", default="0,1,2", help="PPO seeds (comma-separated); the reward model uses the first")
    p.add_argument("--work-dir", default=None, help="where the model, pairs and reward model go (default: temp)")
    a = p.parse_args(argv)
    run(a.iterations, a.pairs, a.epochs, [int(x) for x in a.seeds.split(",")], a.work_dir)


if __name__ == "__main__":
    sys.exit(main())
