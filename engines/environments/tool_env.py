"""An environment in which the policy calls tools by writing them out, and is scored on its final answer.

The policy calls a tool by writing `<TAG>argument</TAG>` in its reply, TAG being one of the environment's tool
tags (`<calc>347 * 29</calc>`). The first call of a reply runs (in its sandbox, engines/environments/tools.py)
and its result comes back as a "tool" message; a reply without a call is the final answer, which `score`
turns into the episode's reward, and the episode ends. A tool that fails (raises, hangs, crashes, runs out
of memory) answers "Error: <what, naming the call>" and the episode goes on: the policy may try again.
More than `max_tool_calls` calls end the episode with reward 0 and info {"stopped": "max_tool_calls"}.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from engines.environments.base import Message, Observation
from engines.environments.tools import SandboxedTool


class ToolCallingEnvironment:
    """Base class: subclasses set `tools` (tag -> SandboxedTool) and define `score`; one instance per sample."""

    tools: Mapping[str, SandboxedTool] = {}
    max_tool_calls: int = 4
    # A final answer scoring at least this is a success (info "is_success", the eval stage's eval/accuracy);
    # None: the task defines no success, and eval reports none.
    success_reward: Optional[float] = None

    def __init__(self):
        self.row: Mapping[str, Any] = {}
        self.tool_calls = 0
        tags = "|".join(re.escape(tag) for tag in self.tools)
        self._call = re.compile(rf"<({tags})>(.*?)</\1>", re.DOTALL) if self.tools else None

    def reset(self, row: Mapping[str, Any]) -> Optional[str]:
        """Keep the row for `score`; the first message is the row's prompt."""
        self.row = row
        return None

    def step(self, messages: list[Message]) -> Observation:
        reply = messages[-1]["content"]
        call = self._call.search(reply) if self._call else None
        if call is None:
            reward, info = self.score(reply), {"tool_calls": self.tool_calls}
            if self.success_reward is not None:
                info["is_success"] = reward >= self.success_reward
            return Observation(reward=reward, done=True, info=info)
        self.tool_calls += 1
        if self.tool_calls > self.max_tool_calls:
            return Observation(done=True, info={"stopped": "max_tool_calls", "tool_calls": self.max_tool_calls})
        tag, argument = call.group(1), call.group(2)
        result = self.tools[tag].call(argument)
        info = {"tool": tag} if result.error is None else {"tool": tag, "tool_error": result.error}
        return Observation(text=result.text, role="tool", info=info)

    def score(self, answer: str) -> float:
        """The final answer's reward; `self.row` is the episode's dataset row."""
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release: tool workers are shared by the process (tools.py) and end with it."""
