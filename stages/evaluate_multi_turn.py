"""The eval stage's multi-turn path (rollout.environment set): every held-out row played through the environment.

    sample_eval_conversations(engine, source, cfg, records, seeds, iteration) -> eval rows (multi-turn columns)
    multi_turn_eval_metrics(scored rows, n) -> {eval/...}

The rows are played exactly as the rollout plays a training row (stages/rollout_env.py, the driver
engines/rollout/multi_turn.py, the limits of rollout.environment), with eval's sampling settings
(stages/evaluate.py eval_sampling: greedy at eval.temperature 0; eval.max_new_tokens caps each policy turn) and
eval's row seeds (each turn's seed derives from the row's, so a retried eval plays the same conversations). The
environment is reset with the held-out row as read from eval.data_path (every column, plus "index").

Metrics, over the eval's conversations (eval.n_samples per held-out row):
- eval/reward_mean: mean of the scored `reward` (the reward sources, as for single-turn eval; with reward.sources
  [{kind: environment}] alone it is the environment's summed reward);
- eval/env_reward_mean: mean of `env_reward`, each conversation's summed environment reward;
- eval/accuracy, eval/pass@1, eval/pass@k (k = n): only when the environment defines success, i.e. some step of
  some conversation put "is_success" in its info (engines/environments/base.py): a conversation succeeded when
  its last step's info says {"is_success": true}; accuracy is the share that did, pass@k the unbiased estimator
  over those 0/1 outcomes (engines/evaluation.py). Without the key nothing is reported (no placeholder);
- eval/turns_mean: mean policy turns per conversation (`turns`);
- eval/truncated_fraction: share of conversations a limit cut short (`truncation` not null: max_turns or
  max_total_tokens).
Every figure is a function of the eval shards' columns, so a person with pyarrow can recompute it.
"""

from __future__ import annotations

import json
from typing import Optional

import pyarrow as pa

from engines.data import PromptSource
from engines.evaluation import eval_metrics
from engines.rollout.base import RolloutEngine, SamplingSettings
from engines.rollout.multi_turn import TurnLimits, run_conversations
from stages.rollout_env import conversation_starts, environment_factory
from stages.tables import rollout_table


def sample_eval_conversations(
    engine: RolloutEngine,
    source: PromptSource,
    cfg,
    records: list,
    sampling: SamplingSettings,
    seeds: list[int],
    iteration: int,
) -> pa.Table:
    """`records` (the held-out PromptRecords of `source`) as `sampling.n` conversations each, as multi-turn rows
    ordered by (row, sample). Errors: the environment's (EnvironmentFailed naming it, the row, the sample and the
    turn), the loader's (naming the spec), the driver's (a first message too long for max_total_tokens)."""
    starts = conversation_starts(source, cfg, records, seeds)
    limits = TurnLimits.from_config(cfg.rollout.environment)
    samples = run_conversations(engine, source.tokenizer, environment_factory(cfg), starts, sampling, limits)
    return rollout_table(records, samples, source.tokenizer, iteration)


def conversation_success(env_info: list[str]) -> Optional[list[bool]]:
    """Per conversation (its `env_info` column: each step's info, JSON), whether its last step said
    {"is_success": true}; None when no step of any conversation carries the key (the environment defines none)."""
    steps = [json.loads(text) for text in env_info]
    if not any("is_success" in info for infos in steps for info in infos):
        return None
    return [bool(infos) and infos[-1].get("is_success") is True for infos in steps]


def multi_turn_eval_metrics(scored: pa.Table, n: int) -> dict[str, float]:
    """The module docstring's metrics of scored multi-turn eval rows, `n` consecutive rows per held-out row.
    ValueError (engines/evaluation.eval_metrics) when the rows are not whole groups of n."""
    cols = scored.select(["reward", "env_reward", "turns", "truncation", "env_info"]).to_pydict()
    rows = len(cols["reward"])
    metrics = {"eval/reward_mean": eval_metrics(cols["reward"], n)["eval/reward_mean"]}
    metrics["eval/env_reward_mean"] = sum(cols["env_reward"]) / rows
    success = conversation_success(cols["env_info"])
    if success is not None:
        outcomes = eval_metrics([float(s) for s in success], n, ks=sorted({1, n}))
        metrics["eval/accuracy"] = outcomes["eval/reward_mean"]
        metrics.update({k: v for k, v in outcomes.items() if k.startswith("eval/pass@")})
    metrics["eval/turns_mean"] = sum(cols["turns"]) / rows
    metrics["eval/truncated_fraction"] = sum(t is not None for t in cols["truncation"]) / rows
    return metrics
