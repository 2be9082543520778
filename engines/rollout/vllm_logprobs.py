"""Which log-probs vLLM returns, and reading them off its outputs.

vLLM 0.32 offers `logprobs_mode`:
  raw_logprobs        log_softmax(logits)          -- before temperature, top-k, top-p
  processed_logprobs  log_softmax(truncate(logits / T)) -- after temperature AND top-k/top-p
The trainer recomputes log_softmax(logits / T) over the whole vocabulary, so
  processed_logprobs is exact when top-p = 1 and top-k is off (any T), and
  raw_logprobs is exact when T = 1 (any truncation).
`logprobs_mode_for(sampling)` picks the exact one; with truncation AND T != 1 neither is exact (vLLM does
not expose pre-truncation log-probs at T), the engine keeps processed_logprobs (the log-probs of the
distribution actually sampled) and warns once.
"""

from __future__ import annotations

from engines.rollout.base import SamplingSettings

LogprobsMode = str  # "processed_logprobs" | "raw_logprobs"
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


def logprobs_mode_for(sampling: SamplingSettings) -> LogprobsMode:
    """The vLLM logprobs_mode whose values equal log_softmax(logits / T) for these settings (see module doc)."""
    truncates = sampling.top_p < 1.0 or sampling.top_k > 0
    if truncates and sampling.temperature == 1.0:
        return "raw_logprobs"
    return "processed_logprobs"


def logprobs_are_exact(mode: LogprobsMode, sampling: SamplingSettings) -> bool:
    """True when vLLM's returned log-probs under `mode` equal the trainer's log_softmax(logits / T)."""
    if mode == "raw_logprobs":
        return sampling.temperature == 1.0
    return sampling.top_p >= 1.0 and sampling.top_k <= 0


def sampled_logprobs(token_ids: list[int], positions) -> list[float]:
    """The sampled token's log-prob at each position. Shape: (response_len,).

    `positions` is vLLM's FlatLogprobs (flat lists, start index per position) or a list of
    {token_id: Logprob} dicts; with logprobs=0 each position holds the sampled token.
    Raises RuntimeError when vLLM's answer misses a position or the sampled token.
    """
    starts = getattr(positions, "start_indices", None)
    if starts is None:
        return [float(step[tok].logprob) for tok, step in zip(token_ids, positions)]
    if len(starts) != len(token_ids):
        raise RuntimeError(f"vLLM returned log-probs for {len(starts)} positions, {len(token_ids)} tokens")
    out = []
    for tok, start, end in zip(token_ids, starts, positions.end_indices):
        hits = [i for i in range(start, end) if positions.token_ids[i] == tok]
        if not hits:
            raise RuntimeError(f"vLLM returned no log-prob for sampled token {tok}")
        out.append(float(positions.logprobs[hits[0]]))
    return out
