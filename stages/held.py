"""The engines a worker process keeps between stages, each under a WarmKey that says what it was built from.

    prompt_source_for(cfg, level)   tokenised prompt set      identity: data settings + dataset/tokenizer files
    eval_prompt_source_for(cfg)     held-out prompt set       identity: the same, for eval.data_path
    scorer_for(cfg)                 reward sources + reference identity: scoring settings + model files
    score_cache_for(cfg, identity)  the score cache's reader identity: its folder URL + size cap
    trainer_key(weights_id)         the DeepSpeed trainer      identity: the weights it holds (PolicyRef.weights_id)

A file rewritten in place under the same path changes its fingerprint (ppoflow/fingerprint.py), so the
engine built from the old file is rebuilt, never silently reused. The trainer moves with take/put (see
engines/warm.py): the update stage takes it for the policy it starts from and puts it back under the
identity of the checkpoint it staged; the rollout stage of the next iteration only peeks at it.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from engines import warm
from engines.data import PromptSource
from engines.models import load_tokenizer
from engines.scoring.scorer import Scorer
from ppoflow.fingerprint import folder_fingerprint, json_hash
from storage.layout import RunLayout
from storage.score_cache import ScoreCache


def prompt_source_for(cfg, level: Optional[int] = None) -> PromptSource:
    """The worker's tokenised prompt set, built once per data settings and files (tokenising the whole dataset
    every iteration would cost more than sampling on the tiny model). The tokenizer is the initial model's:
    checkpoints save the same tokenizer files beside the policy weights. `level`: that curriculum level's rows
    (data.reasoning_gym.curriculum; engines/reasoning_tasks.level_train_path), else data.path."""
    if level is None:
        return _prompt_source(cfg, warm.Role.PROMPTS, cfg.data)
    from engines.reasoning_tasks import level_train_path

    level_data = cfg.data.model_copy(update={"path": str(level_train_path(cfg, level))})
    return _prompt_source(cfg, warm.Role.PROMPTS, level_data)


def eval_prompt_source_for(cfg) -> PromptSource:
    """The held-out prompts of the eval stage: eval.data_path read with data's columns and limits, kept warm
    under a role of its own (so the training prompts and the eval prompts do not evict each other)."""
    return _prompt_source(cfg, warm.Role.EVAL_PROMPTS, cfg.data.model_copy(update={"path": cfg.eval.data_path}))


def _prompt_source(cfg, role: warm.Role, data_cfg) -> PromptSource:
    identity = json.dumps(
        [
            json_hash(data_cfg.model_dump(mode="json")),
            os.path.abspath(cfg.model.policy_path),
            cfg.model.apply_chat_template,
            _fingerprint_or_none(data_cfg.path),
            folder_fingerprint(cfg.model.policy_path),
        ]
    )
    return warm.get_or_build(
        warm.WarmKey(role, identity),
        lambda: PromptSource(data_cfg, load_tokenizer(cfg.model.policy_path), cfg.model.apply_chat_template),
    )


def _fingerprint_or_none(path: str):
    # A missing dataset path is PromptSource's error to report (it names the field); the key just says so.
    return folder_fingerprint(path) if os.path.exists(path) else None


def scorer_for(cfg) -> Scorer:
    """The warm scorer; rebuilt when the scoring settings change, and when the files of the reference or of a
    reward-model folder change in place (new weights under the same path). A rebuilt scorer has a new
    identity, so a new score-cache key space: the new weights never read the old weights' scores.
    The reference's micro-batch and log-prob chunk (train.micro_batch_size, train.logprob_chunk: build_reference)
    are in the key too: they move its log-probs by rounding, and a scorer built for another run's settings would make
    this run's scores depend on what the process ran before."""
    folders = [cfg.model.policy_path] + [s.target for s in cfg.reward.sources if s.kind == "model"]
    reference_batching = [cfg.train.micro_batch_size, cfg.train.logprob_chunk]
    identity = json.dumps(
        [
            cfg.section_hash("model", "reward", "score", "rollout"),
            reference_batching,
            [folder_fingerprint(f) for f in folders],
        ]
    )
    return warm.get_or_build(warm.WarmKey(warm.Role.SCORER, identity), lambda: Scorer(cfg))


def score_cache_for(cfg, layout: RunLayout, scorer_identity: str) -> ScoreCache:
    """The score cache of this scorer, kept warm between iterations: a new reader would read every segment in
    the folder again, the warm one reads only the segments other processes wrote since it last looked."""
    folder = layout.score_cache_dir(scorer_identity)
    identity = json.dumps([layout.url(folder), cfg.score.cache_max_bytes])
    return warm.get_or_build(
        warm.WarmKey(warm.Role.SCORE_CACHE, identity),
        lambda: ScoreCache(layout.fs, folder, max_bytes=cfg.score.cache_max_bytes),
    )


def trainer_key(weights_id: str) -> warm.WarmKey:
    """The key of a trainer holding exactly the weights (and optimizer state) `weights_id` names."""
    return warm.WarmKey(warm.Role.TRAINER, weights_id)
