"""Multi-turn rollout: conversations with an environment, driven turn by turn over ANY RolloutEngine.generate.

    run_conversations(engine, tokenizer, factory, starts, sampling, limits) -> [ConversationSample]

One conversation per (prompt row, sample j): the row's n samples are n conversations, each with an environment
instance of its own (engines/environments/base.py). Turn t, for every conversation still running:

    1. the policy generates one assistant turn from the conversation's token ids so far (one batched
       engine.generate call per turn, n = 1 per conversation, seed = turn_seed(row seed, j, t));
    2. its sampled ids are appended as they are (never decoded and re-tokenized: the trainer must score exactly
       the tokens the sampler drew) and decoded only to give the environment the message's text;
    3. env.step(messages) answers; its reward is added to the sample's env_reward; done ends the episode;
    4. otherwise the observation is appended as the chat template renders it: what is left of the template's
       end-of-turn suffix after the reply (less the EOS the policy sampled), then the text that
       template(messages + [observation], add_generation_prompt=True) adds to template(messages), tokenized on
       its own (no special tokens added; see observation_ids). Those tokens are the environment's
       (token_owner 0): context only.

Engines: vLLM reuses the computed KV of the shared prefix when its prefix caching is on (vLLM's default;
engines/rollout/vllm_engine.py leaves it on); HF generate recomputes each turn's prefix (correct, slower).

Limits (never silent): a conversation still running after `max_turns` policy turns ends with truncation
"max_turns"; one whose prompt + turns would pass `max_total_tokens` has its last turn cut to fit (a sampled
prefix is still an exact sample: the engines draw token by token) or its observation left out, and ends with
truncation "max_total_tokens". Either way finish_reason is "length" (train.mask_truncated drops such rows);
an episode the environment ended has finish_reason "stop".

Reproducibility: every turn's seed is a function of (row seed, sample, turn), the row seed of (run seed,
iteration, row) (engines/rollout/base.py), so a retried or resumed rollout draws the same conversations as long
as the environment is deterministic given the row and the conversation.

Errors: with on_env_failure "record" (the rollout stage), an environment that fails ends its own conversation only,
which comes back with env_error set (stages/env_failures.py drops its whole group). Otherwise ("raise", the
default, the eval's): an environment whose factory, reset or step raises, or returns the wrong type, fails the
call with one EnvironmentFailed (engines/environments/checked.py: CheckedEnvironment) naming the environment, the row,
the sample and the turn (a call that hangs times out there); every environment opened is
closed (close errors are reported only when nothing else failed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

from engines.environments.base import Message
from engines.environments.checked import CheckedEnvironment, EnvironmentFailed
from engines.environments.loader import EnvironmentFactory
from engines.rollout.base import RolloutEngine, RolloutSample, SamplingSettings

OWNER_POLICY, OWNER_ENVIRONMENT = 1, 0


@dataclass(frozen=True)
class TurnLimits:
    """max_turns: policy turns per conversation; max_total_tokens: prompt + every turn's tokens."""

    max_turns: int
    max_total_tokens: int

    @classmethod
    def from_config(cls, env_cfg) -> "TurnLimits":
        return cls(max_turns=env_cfg.max_turns, max_total_tokens=env_cfg.max_total_tokens)


@dataclass(frozen=True)
class ConversationStart:
    """One prompt row to run: `row` is what env.reset sees (the dataset row's columns plus "index");
    `prompt_ids` / `prompt_text` the row's prompt as the chat template renders it (used when reset returns None);
    `prompt` the user message's content; `seed` the row's sampling seed (prompt_sampling_seed)."""

    index: int
    row: Mapping[str, Any]
    prompt: str
    prompt_text: str
    prompt_ids: list[int]
    seed: int


@dataclass
class ConversationSample(RolloutSample):
    """A RolloutSample whose response is a whole conversation after the first prompt (policy and environment
    tokens in order). token_owner (response_len,): 1 = policy token, 0 = environment token; turn_starts: index in
    response_ids where each message begins; rollout_logprobs are 0 at environment tokens (never read)."""

    prompt_text: str = ""
    token_owner: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    env_reward: float = 0.0
    turns: int = 0
    truncation: Optional[str] = None
    messages: list[Message] = field(default_factory=list)
    env_info: list[dict] = field(default_factory=list)  # each step's Observation.info, in turn order
    env_error: Optional[str] = None  # on_env_failure="record": the EnvironmentFailed that ended it (never trained)


def turn_seed(row_seed: int, sample_index: int, turn: int) -> int:
    """Sampling seed of turn `turn` of sample `sample_index` of a row seeded `row_seed` (63-bit)."""
    digest = hashlib.sha256(f"turn:{row_seed}:{sample_index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


_SENTINEL = "\u2063ppoflow-reply\u2063"  # stands for the reply's text, to find what the template writes after it


def observation_ids(
    tokenizer, messages: list[Message], observation: Message, reply_ids: Sequence[int] = ()
) -> list[int]:
    """The environment's tokens for `observation` after `messages` (whose last one is the policy's reply, sampled
    as `reply_ids`), tokenized on their own, no special tokens added. They are the text the chat template writes
    after the reply's content: its end-of-turn suffix, less the part the policy sampled itself (a reply that
    stopped on EOS sampled ChatML's "<|im_end|>", and "\n" is left; a reply cut at max_new_tokens leaves the
    whole "<|im_end|>\n"), then the observation and the next generation prompt, as
    template(messages + [observation], add_generation_prompt=True) adds them to template(messages). So the
    conversation's ids are the template's rendering of its messages, but for the policy's own ids.

    ValueError when the template does not render `messages` as a prefix of the longer conversation (it rewrites
    earlier turns: no delta exists)."""
    before = tokenizer.apply_chat_template(messages, tokenize=False)
    after = tokenizer.apply_chat_template(messages + [observation], tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError(
            "the tokenizer's chat template renders a conversation differently once a message is appended (it "
            "rewrites earlier turns), so an observation cannot be appended as tokens; multi-turn needs a template "
            "that only appends"
        )
    return list(
        tokenizer(_reply_suffix(tokenizer, messages, reply_ids) + after[len(before) :], add_special_tokens=False)[
            "input_ids"
        ]
    )


def _reply_suffix(tokenizer, messages: list[Message], reply_ids: Sequence[int]) -> str:
    """What the template writes after the last (assistant) message's content, less the reply's last token's text
    when the suffix starts with it, leading whitespace aside (the EOS the policy sampled); "" when the template
    does not show the content as written (it trims or escapes it: nothing can be said about its suffix)."""
    marked = messages[:-1] + [{**messages[-1], "content": _SENTINEL}]
    rendered = tokenizer.apply_chat_template(marked, tokenize=False)
    if rendered.count(_SENTINEL) != 1:
        return ""
    suffix = rendered.split(_SENTINEL, 1)[1]
    last = tokenizer.decode(list(reply_ids)[-1:]) if len(reply_ids) else ""
    if last and suffix.lstrip().startswith(last):  # whitespace before it: a word-level tokenizer's decode drops it
        return suffix.lstrip()[len(last) :]
    return suffix


@dataclass
class _Conversation:
    start: ConversationStart
    position: int  # index of `start` in the starts run together (RolloutSample.prompt_index)
    sample_index: int
    env: Optional[CheckedEnvironment]  # None: the environment failed before it existed (on_env_failure "record")
    messages: list[Message]
    prompt_text: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    env_reward: float = 0.0
    turns: int = 0
    ended: bool = False
    truncation: Optional[str] = None
    policy_version: int = 0
    infos: list[dict] = field(default_factory=list)
    error: Optional[str] = None

    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(self, ids: Sequence[int], logprobs: Sequence[float], owner: int) -> None:
        self.turn_starts.append(len(self.response_ids))
        self.response_ids.extend(int(t) for t in ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.owner.extend([owner] * len(ids))

    def finish(self, truncation: Optional[str]) -> None:
        self.ended, self.truncation = True, truncation

    def sample(self) -> ConversationSample:
        return ConversationSample(
            prompt_index=self.position,
            sample_index=self.sample_index,
            prompt_ids=list(self.prompt_ids),
            response_ids=self.response_ids,
            rollout_logprobs=self.logprobs,
            finish_reason="length" if self.truncation else "stop",
            policy_version=self.policy_version,
            prompt_text=self.prompt_text,
            token_owner=self.owner,
            turn_starts=self.turn_starts,
            env_reward=self.env_reward,
            turns=self.turns,
            truncation=self.truncation,
            messages=self.messages,
            env_info=self.infos,
            env_error=self.error,
        )


def _open(
    start: ConversationStart, position: int, j: int, factory: EnvironmentFactory, tokenizer, opened: list
) -> _Conversation:
    """Build sample j's environment, reset it for the row, and render the first user message."""
    env = CheckedEnvironment.start(factory, row_index=start.index, sample_index=j)
    opened.append(env)
    first = env.reset(start.row)
    conv = _Conversation(start, position, j, env, [], start.prompt_text, list(start.prompt_ids))
    conv.messages = [{"role": "user", "content": start.prompt if first is None else first}]
    if first is not None:  # the environment's own first message replaces the dataset's prompt
        conv.prompt_text = tokenizer.apply_chat_template(conv.messages, tokenize=False, add_generation_prompt=True)
        conv.prompt_ids = list(tokenizer(conv.prompt_text, add_special_tokens=False)["input_ids"])
    return conv


def _open_or_record(start, position: int, j: int, factory, tokenizer, opened: list, record: bool) -> _Conversation:
    """_open; with `record`, an EnvironmentFailed gives a conversation that ended with it instead (no turn)."""
    before = len(opened)
    try:
        return _open(start, position, j, factory, tokenizer, opened)
    except EnvironmentFailed as e:
        if not record:
            raise
        env = opened[-1] if len(opened) > before else None  # built, then its reset failed
        conv = _Conversation(start, position, j, env, [], start.prompt_text, list(start.prompt_ids))
        conv.error = str(e)
        conv.finish("environment_failed")
        if env is not None:
            env.close(raise_errors=False)
        return conv


def _fail(c: _Conversation, error: EnvironmentFailed) -> None:
    """End `c` with `error` (on_env_failure="record"); its environment is closed now, quietly: it broke already."""
    c.error = str(error)
    c.finish("environment_failed")
    c.env.close(raise_errors=False)


def _generate_turn(
    engine: RolloutEngine, active: list[_Conversation], sampling: SamplingSettings, turn: int, limits: TurnLimits
) -> None:
    """One policy turn for every active conversation, batched per token budget (most share the full one)."""
    budgets: dict[int, list[_Conversation]] = {}
    for c in active:
        budget = min(sampling.max_new_tokens, limits.max_total_tokens - c.length())
        budgets.setdefault(budget, []).append(c)
    for budget, group in sorted(budgets.items()):
        settings = replace(sampling, n=1, max_new_tokens=budget)
        seeds = [turn_seed(c.start.seed, c.sample_index, turn) for c in group]
        samples = engine.generate([c.prompt_ids + c.response_ids for c in group], settings, seeds)
        for c, s in zip(group, samples):
            c.append(s.response_ids, s.rollout_logprobs, OWNER_POLICY)
            c.turns += 1
            c.policy_version = s.policy_version


def _step(c: _Conversation, turn: int, tokenizer, limits: TurnLimits, reply_ids: list[int]) -> None:
    """Show the environment the policy's newest turn; end the episode or append its observation."""
    c.messages.append({"role": "assistant", "content": tokenizer.decode(reply_ids, skip_special_tokens=True)})
    obs = c.env.step(list(c.messages))
    c.env_reward += float(obs.reward)
    c.infos.append(dict(obs.info))
    if obs.done:
        return c.finish(None)
    if c.turns >= limits.max_turns:
        return c.finish("max_turns")
    message = {"role": obs.role, "content": obs.text}
    try:
        ids = observation_ids(tokenizer, c.messages, message, reply_ids)
    except ValueError as e:
        raise ValueError(f"row {c.start.index}, sample {c.sample_index}, turn {turn + 1}: {e}") from None
    if c.length() + len(ids) + 1 > limits.max_total_tokens:  # no room for the observation and one policy token
        return c.finish("max_total_tokens")
    c.messages.append(message)
    c.append(ids, [0.0] * len(ids), OWNER_ENVIRONMENT)


def run_conversations(
    engine: RolloutEngine,
    tokenizer,
    factory: EnvironmentFactory,
    starts: Sequence[ConversationStart],
    sampling: SamplingSettings,
    limits: TurnLimits,
    on_env_failure: str = "raise",
) -> list[ConversationSample]:
    """`sampling.n` conversations per start, ordered by (start, sample); see the module docstring.

    on_env_failure "raise": the first EnvironmentFailed (engines/environments/checked.py, naming the environment,
    the row, the sample and the turn) fails the call. "record": it ends that conversation only, which comes back
    with `env_error` set and no further turns; the others go on (the caller drops the whole group:
    stages/env_failures.py). ValueError naming the row when the first message leaves no room under max_total_tokens, and
    before any work when max_total_tokens is more than the engine's context.
    """
    _check_context(engine, limits)
    opened: list[CheckedEnvironment] = []
    convs: list[_Conversation] = []
    try:
        record = on_env_failure == "record"
        for position, start in enumerate(starts):
            for j in range(sampling.n):
                convs.append(_open_or_record(start, position, j, factory, tokenizer, opened, record))
        _check_room([c for c in convs if c.error is None], limits)
        for turn in range(limits.max_turns):
            active = [c for c in convs if not c.ended]
            if not active:
                break
            before = {id(c): len(c.response_ids) for c in active}
            _generate_turn(engine, active, sampling, turn, limits)
            for c in active:
                try:
                    _step(c, turn, tokenizer, limits, c.response_ids[before[id(c)] :])
                except EnvironmentFailed as e:
                    if not record:
                        raise
                    _fail(c, e)
                if not c.ended and c.length() >= limits.max_total_tokens:
                    c.finish("max_total_tokens")
    except BaseException:
        for env in opened:  # the first error is the one to report: a failing close must not mask it
            env.close(raise_errors=False)
        raise
    failed = {id(c.env) for c in convs if c.error is not None}
    for env in opened:
        if id(env) not in failed:  # (a failed one was closed when it failed)
            env.close()
    return [c.sample() for c in convs]


def _check_context(engine: RolloutEngine, limits: TurnLimits) -> None:
    """ValueError when a conversation may outgrow the engine's context (vLLM's max_model_len, the HF model's
    positions): every turn is then sure to fit, instead of an engine error naming a prompt of some turn."""
    context = getattr(engine, "max_model_len", None) or getattr(engine, "max_positions", None)
    if context and limits.max_total_tokens > context:
        raise ValueError(
            f"rollout.environment.max_total_tokens={limits.max_total_tokens} is more than the {engine.name} engine's "
            f"context of {context} tokens; set it to at most {context}"
        )


def _check_room(convs: list[_Conversation], limits: TurnLimits) -> None:
    for c in convs:
        if c.length() >= limits.max_total_tokens:
            raise ValueError(
                f"row {c.start.index}: the first user message is {c.length()} tokens, leaving no room for a turn "
                f"under rollout.environment.max_total_tokens={limits.max_total_tokens}"
            )
