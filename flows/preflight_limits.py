"""Token limits checked against the policy's context before iteration 1, with a fix that itself validates.

A multi-turn conversation (prompt + every turn) is at most `rollout.environment.max_total_tokens` tokens; the
engine refuses more than its context (vLLM's rollout.max_model_len, else the policy's max_position_embeddings). The
engine found that only when it started, in iteration 1's rollout (~40 s in), and suggested "at most <context>",
which the config itself refuses when data.max_prompt_tokens >= <context> (max_total_tokens must be greater).

`limit_problems(cfg)` reads config.json of the policy (no weights, no tokenizer) and returns one problem naming
the fields, the context and where it comes from, and a `--set` fix that passes the config's validation:
max_total_tokens = the context, and, when the prompts' limit leaves no room under it, data.max_prompt_tokens =
the context - rollout.max_new_tokens (a prompt of the allowed length still has room for one whole reply; half the
context when a reply alone fills it). A policy folder without a readable config.json is model_folder_problems'
to name.

`room_problems(cfg, prompt_ids)`: the single-turn counterpart, once the prompts are tokenised (flows/preflight.py):
the longest prompt plus rollout.max_new_tokens must fit the context too (the engine refused that prompt in
iteration 1); the fix is rollout.max_new_tokens = the context - the longest prompt, when that leaves a token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from ppoflow.config import PPOFlowConfig


def policy_context(cfg: PPOFlowConfig) -> Optional[tuple[int, str]]:
    """(tokens, where that number comes from) of the rollout engine's context, or None when it is unknown."""
    try:
        positions = json.loads((Path(cfg.model.policy_path).expanduser() / "config.json").read_text())
        positions = positions.get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        positions = None
    where = f"max_position_embeddings of {cfg.model.policy_path}/config.json"
    candidates = [(int(positions), where)] if isinstance(positions, int) and positions > 0 else []
    if cfg.rollout.max_model_len and cfg.rollout.engine != "hf":  # vLLM's setting; HF generate ignores it
        candidates.append((cfg.rollout.max_model_len, "rollout.max_model_len"))
    return min(candidates) if candidates else None


def suggested_limits(cfg: PPOFlowConfig, context: int) -> list[str]:
    """`--set` items that make a conversation fit `context` tokens and still validate (see the module doc)."""
    fix = [f"rollout.environment.max_total_tokens={context}"]
    if cfg.data.max_prompt_tokens >= context:
        room = context - cfg.rollout.max_new_tokens
        fix.append(f"data.max_prompt_tokens={room if room >= 1 else max(1, context // 2)}")
    return fix


def limit_problems(cfg: PPOFlowConfig) -> list[str]:
    """One problem when a multi-turn conversation may outgrow the policy's context (see the module docstring)."""
    env = cfg.rollout.environment
    found = policy_context(cfg) if env is not None else None
    if found is None or env.max_total_tokens <= found[0]:
        return []
    context, where = found
    fix = " ".join(f"--set {item}" for item in suggested_limits(cfg, context))
    return [
        f"rollout.environment.max_total_tokens={env.max_total_tokens} is more than the policy's context of "
        f"{context} tokens ({where}); a conversation must fit it. Fix: {fix}"
    ]


def room_problems(cfg: PPOFlowConfig, prompt_ids: Sequence[Sequence[int]]) -> list[str]:
    """One problem when the longest tokenised prompt plus rollout.max_new_tokens outgrows the policy's context
    (single-turn rollouts; a conversation is limit_problems'). `prompt_ids`: every prompt as the rollout sends it."""
    found = policy_context(cfg) if cfg.rollout.environment is None and prompt_ids else None
    if found is None:
        return []
    context, where = found
    row = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    longest = len(prompt_ids[row])
    if longest + cfg.rollout.max_new_tokens <= context:
        return []
    room = context - longest
    fix = f"--set rollout.max_new_tokens={room}" if room >= 1 else f"shorten row {row} (or drop it)"
    return [
        f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: the longest prompt ({cfg.data.path} row {row}, "
        f"{longest} tokens) plus that many new tokens is more than the policy's context of {context} tokens "
        f"({where}). Fix: {fix}"
    ]
