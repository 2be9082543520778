"""The environment contract: what a multi-turn rollout talks to between the policy's turns.

One environment instance serves one sample (one prompt row, one of its `n` samples). The rollout:

    env = factory()                              # a fresh instance per sample, built in the rollout worker
    first = env.reset(row)                       # row: the dataset row (prompt, label, ... as read from data.path)
    messages = [{"role": "user", "content": first or row["prompt"]}]
    while True:
        reply = <policy generates one assistant turn from the chat template of `messages`>
        messages.append({"role": "assistant", "content": reply})
        obs = env.step(messages)                 # sees the whole conversation so far
        if obs.done or <a turn or token limit is hit>: break
        messages.append({"role": obs.role, "content": obs.text})
    env.close()

The sample's environment reward is the sum of the `reward`s of every Observation it returned. Only the
policy's own (assistant) tokens are trained on and take KL; the observation tokens are context. Success, for the
eval stage's accuracy, is the environment's to say: `info["is_success"]` (see Observation).

Failure modes an implementation must meet with one clear error naming the environment, the row and the turn:
`reset`/`step` raising, returning the wrong type, or never returning `done` within the turn limit (recorded as a
truncation, not an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Protocol, runtime_checkable

Message = dict[str, str]  # {"role": "system" | "user" | "assistant" | "tool", "content": str}


@dataclass(frozen=True)
class Observation:
    """An environment's answer to one policy turn.

    text:   the next message's content (a tool result or the next user turn); ignored when `done`.
    role:   "user" (the next user turn) or "tool" (a tool's result), as the chat template renders it.
    reward: this turn's reward; the sample's environment reward is the sum over its turns.
    done:   the episode is over; no further policy turn is generated.
    info:   JSON-able extra facts recorded with the sample (e.g. {"tool_error": "..."}); never read by training.
            One key has a meaning: "is_success" (a bool), gymnasium's and Stable-Baselines3's success flag. A
            conversation succeeded when the last step it got says {"is_success": True}; an environment that sets
            the key defines success, and the eval stage then reports eval/accuracy and eval/pass@k over it
            (stages/evaluate_multi_turn.py). Set it on every step (False until won), so a conversation a limit
            cut short counts as a failure and the metric exists even when no episode was won.
    """

    text: str = ""
    role: Literal["user", "tool"] = "user"
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment. Built with no arguments by its factory, once per sample."""

    def reset(self, row: Mapping[str, Any]) -> Optional[str]:
        """Start an episode for dataset row `row`; return the first user message, or None for row["prompt"]."""
        ...

    def step(self, messages: list[Message]) -> Observation:
        """Answer the conversation so far, whose last message is the policy's newest assistant turn."""
        ...

    def close(self) -> None:
        """Release what the episode holds (processes, files). Called once, also after an error."""
        ...
