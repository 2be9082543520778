"""The eval stage: sample the held-out prompts with a committed policy, score them, write eval shards.

    eval_due(cfg, iteration) -> bool                        does iteration `iteration` end with an eval
    eval_sampling(cfg) -> SamplingSettings                  eval.* over rollout.* (0 = greedy)
    run_eval(cfg, iteration, policy) -> EvalManifest        the stage: engine, prompts, scores, shards, metrics

The flow runs it after iteration i's checkpoint with the policy that checkpoint committed (version i), every
eval.every iterations and at the last one. It runs where rollout runs (its engine is the rollout engine:
the warm worker serving rollout serves eval too; on pools, pipeline.stage_pools.eval on the rollout pool).

What it computes, and the choices made:
- every row of eval.data_path, eval.n_samples samples each, with the rollout engine of this process
  (rollout_engine_for: the warm trainer's weights in memory, else the committed checkpoint's policy/);
- temperature 0 is greedy, sampled as top-k 1 (the HF sampler cannot divide by 0; vLLM treats both alike);
  otherwise eval.temperature with rollout.top_p / top_k;
- seeds: dataset row r uses `eval_sampling_seed(run.seed, r)`, the same in every iteration, so two
  iterations' evals differ only by the policy (common random numbers), and a retried or resumed eval
  draws the same samples;
- scored by the score stage's scorer (reward sources + reference) through the score cache, so the rows
  are scored rows and `eval/reward_mean` is the mean of their `reward` column;
- eval.sampled_pass_at_k (the initial eval by default): the held-out prompts sampled again as the rollout samples
  them, for eval/sampled_pass@k (k = rollout.n_samples) and eval/sampled_spread beside the greedy figures
  (stages/evaluate_sampled.py);
- metrics: engines/evaluation.eval_metrics: eval/reward_mean, and when every reward is 0 or 1, eval/pass@1
  and eval/pass@k for k = eval.n_samples (the unbiased estimator); when the held-out rows name two data sources
  or more, the same per source as eval/<data_source>/<metric> (per_data_source);
- multi-turn (rollout.environment set): each held-out row is played through the environment by the rollout's
  driver, with the sampling above and rollout.environment's limits; the shards have the multi-turn columns and the
  metrics are stages/evaluate_multi_turn.py's (eval/reward_mean, eval/env_reward_mean, eval/accuracy and
  eval/pass@k where the environment defines success, eval/turns_mean, eval/truncated_fraction).
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from engines import warm
from engines.evaluation import eval_metrics
from engines.rollout.base import SamplingSettings
from stages.engine_replacement import with_live_engine
from stages.evaluate_multi_turn import multi_turn_eval_metrics, sample_eval_conversations
from stages.evaluate_sampled import sample_as_rollout, sampled_due, sampled_metrics
from stages.held import eval_prompt_source_for, score_cache_for, scorer_for
from stages.manifests import EvalManifest, PolicyRef
from stages.rollout import rollout_engine_for, sample_table, sampled_manifest
from stages.score import score_rows
from stages.tables import write_stage_table
from storage.layout import layout_for


def eval_due(cfg, iteration: int) -> bool:
    """True when eval.data_path is set and `iteration` is a multiple of eval.every or the run's last."""
    return bool(cfg.eval.data_path) and (iteration % cfg.eval.every == 0 or iteration == cfg.run.iterations)


def eval_sampling(cfg) -> SamplingSettings:
    """The eval's sampling settings: eval.n_samples / temperature / max_new_tokens over rollout's others."""
    greedy = cfg.eval.temperature == 0
    return SamplingSettings(
        n=cfg.eval.n_samples,
        temperature=1.0 if greedy else cfg.eval.temperature,
        top_p=1.0 if greedy else cfg.rollout.top_p,
        top_k=1 if greedy else cfg.rollout.top_k,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        stop_token_ids=tuple(cfg.rollout.stop_token_ids),
    )


def eval_sampling_seed(run_seed: int, row: int) -> int:
    """Sampling seed of held-out row `row` (63-bit); a function of (run seed, row) only, see the docstring."""
    digest = hashlib.sha256(f"eval:{run_seed}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def run_eval(cfg, iteration: int, policy: PolicyRef) -> EvalManifest:
    """Evaluate `policy` (the checkpoint iteration `iteration` committed) on eval.data_path; write the scored
    samples as the iteration's eval shards (replacing what the folder held, manifest last).

    Errors: a missing or malformed eval dataset is PromptSource's error naming the file and row; a reward
    source's error propagates and names the sample ("iter 3 prompt 12 sample 1"); multi-turn, an environment
    that breaks its contract is the rollout's EnvironmentFailed naming it, the held-out row, the sample and the turn.
    """
    started = time.perf_counter()
    source = eval_prompt_source_for(cfg)
    records = source.records(list(range(len(source))))
    seeds = [eval_sampling_seed(cfg.run.seed, r.index) for r in records]
    multi_turn = cfg.rollout.environment is not None
    with warm.stage_lock("rollout"):  # pipelined iterations: the rollout engine serves one stage at a time

        def sample(engine):
            if multi_turn:
                table = sample_eval_conversations(engine, source, cfg, records, eval_sampling(cfg), seeds, iteration)
            else:
                table = sample_table(engine, source, records, eval_sampling(cfg), seeds, iteration)
            # eval.sampled_pass_at_k: the same prompts as the rollout samples them (stages/evaluate_sampled.py)
            due = sampled_due(cfg, iteration)
            return table, sample_as_rollout(engine, source, records, cfg, seeds, iteration) if due else None

        # an engine whose process dies is built again and samples again (stages/engine_replacement.py)
        (table, sampled), engine, attested, _ = with_live_engine(
            rollout_engine_for, cfg, policy, "eval", iteration, sample
        )
    layout = layout_for(cfg)
    scorer = scorer_for(cfg)
    cache = score_cache_for(cfg, layout, scorer.identity) if cfg.score.cache else None
    scored, _ = score_rows(scorer, table, cache)
    written = write_stage_table(cfg, layout, iteration, "eval", scored)
    metrics_of = multi_turn_eval_metrics if multi_turn else single_turn_eval_metrics
    n = cfg.eval.n_samples
    metrics = {**metrics_of(scored, n), **per_data_source(metrics_of, scored, n)}
    if sampled is not None:
        metrics.update(sampled_metrics(score_rows(scorer, sampled, cache)[0], cfg.rollout.n_samples))
    return sampled_manifest(
        EvalManifest,
        written,
        iteration,
        started,
        policy_version=policy.version,
        engine=engine.name,
        metrics=metrics,
        attested=attested,
    )


def single_turn_eval_metrics(scored: pa.Table, n: int) -> dict[str, float]:
    """engines/evaluation.eval_metrics of the scored rows' rewards, n consecutive rows per held-out prompt."""
    return eval_metrics(scored.column("reward").to_pylist(), n, ks=sorted({1, n}))


def per_data_source(metrics_of: Callable[[pa.Table, int], dict], scored: pa.Table, n: int) -> dict[str, float]:
    """`metrics_of` over each data_source's rows alone, as eval/<data_source>/<metric>, when the held-out rows
    name two data sources or more (one source would repeat the overall figures); rows without one count only in
    the overall figures. A prompt's n samples share its data_source, so each subset is whole groups."""
    column = scored.column("data_source")
    sources = sorted({s for s in column.to_pylist() if s is not None})
    if len(sources) < 2:
        return {}
    out: dict[str, float] = {}
    for source in sources:
        subset = scored.filter(pc.equal(column, source))
        out.update({f"eval/{source}/{k.removeprefix('eval/')}": v for k, v in metrics_of(subset, n).items()})
    return out
