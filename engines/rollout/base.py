"""The rollout interface that every generation engine (HF generate, vLLM) implements.

Shapes are ragged lists, not tensors: prompts and responses have different lengths and the samples go
straight into Arrow list columns.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, Optional, Protocol, Sequence, runtime_checkable

FinishReason = Literal["stop", "length"]


def prompt_sampling_seed(run_seed: int, iteration: int, prompt_index: int) -> int:
    """Sampling seed of dataset row `prompt_index` in `iteration` (63-bit, stable across processes).

    A function of (run seed, iteration, dataset row) only, so a retried or resumed rollout draws exactly the
    samples the first attempt drew whatever ran before in the process, and the bare engine loop and the
    pipeline draw the same samples for the same iteration.
    """
    digest = hashlib.sha256(f"rollout:{run_seed}:{iteration}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample. `temperature` is also the temperature at which the returned log-probs are taken."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS

    @classmethod
    def from_config(cls, rollout_cfg) -> "SamplingSettings":
        return cls(
            n=rollout_cfg.n_samples,
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop_token_ids=tuple(rollout_cfg.stop_token_ids),
        )


@dataclass
class RolloutSample:
    """One sampled response.

    prompt_ids:       (prompt_len,) token ids of the prompt as sent to the engine.
    response_ids:     (response_len,) generated ids, including the EOS/stop token when finish_reason == "stop".
    rollout_logprobs: (response_len,) the sampler's log-prob of each generated token, at `temperature`,
                      before top-p/top-k truncation (what the trainer recomputes).
    """

    prompt_index: int  # index into the prompts passed to generate()
    sample_index: int  # 0..n-1 within the prompt's group
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int = 0


class EngineDied(RuntimeError):
    """The engine's own process died under a call (vLLM's EngineCore: killed, out of memory, a segfault). The engine
    object is unusable from then on: drop it (registry.discard) and build another."""


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine. Long-lived: built once per worker process, weights refreshed per iteration."""

    name: str  # "hf" or "vllm"
    policy_version: int  # version of the weights it serves now

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, seeds: Optional[Sequence[int]] = None
    ) -> list[RolloutSample]:
        """Sample `sampling.n` responses for each prompt. `seeds[i]` (optional) fixes prompt i's samples.

        Returns len(prompts) * n samples ordered by (prompt_index, sample_index).
        Raises ValueError naming the prompt when a prompt is empty or longer than the engine allows.
        """
        ...

    def load_weights(self, policy_dir: str, version: int) -> None:
        """Serve the Hugging Face policy folder `policy_dir` from now on, tagging samples with `version`."""
        ...

    def weights_digest(self):
        """The WeightsDigest of the weights it computes with, read where they live (engines/weights_digest.py);
        `digest_precision` (None or an autocast dtype) names the rounding it is taken at."""
        ...

    def shutdown(self) -> None: ...
