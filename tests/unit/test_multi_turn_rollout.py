"""Multi-turn rollout with HF generate on the tiny model, against the scripted environments of
tests/fixtures/digit_env.py: ownership against the chat template rendered here by hand, the policy's ids against
a replay of each turn, the trainer's log-probs against the sampler's, limits, bad environments.

The tiny model's chat template (engines/toy/model.py) renders a message as "{role} : {content} " and the
generation prompt as "assistant : ", one word a token: an observation after a policy turn is therefore exactly
the tokens of "{role} : {text} assistant : ".
"""

import pytest
import torch

from engines.environments.checked import EnvironmentFailed
from engines.environments.loader import load_environment_factory
from engines.models import load_policy
from engines.rollout.base import SamplingSettings
from engines.rollout.hf import HFRolloutEngine
from engines.rollout.multi_turn import ConversationStart, TurnLimits, run_conversations, turn_seed
from engines.trainer.experience import ExperienceBatch
from engines.trainer.forward import policy_forward
from tests.fixtures.digit_env import GIVE_UP

ENV = "tests.fixtures.digit_env:"
SAMPLING = SamplingSettings(n=3, max_new_tokens=5, temperature=1.0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFRolloutEngine(str(tiny_model_dir), seed=0, max_batch_size=8)


def _starts(tokenizer, rows=((5, "say 7 :", "7"), (9, "repeat 3 :", "3"))) -> list[ConversationStart]:
    starts = []
    for index, prompt, label in rows:
        text = f"user : {prompt} assistant : "
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        row = {"prompt": prompt, "label": label, "index": index}
        starts.append(ConversationStart(index, row, prompt, text, ids, seed=1000 + index))
    return starts


def _run(engine, env="DigitGuessEnv", limits=TurnLimits(4, 200), sampling=SAMPLING, starts=None):
    starts = starts or _starts(engine.tokenizer)
    return run_conversations(engine, engine.tokenizer, load_environment_factory(ENV + env), starts, sampling, limits)


def _spans(sample) -> list[tuple[int, list[int]]]:
    """(owner, ids) of each message after the prompt, cut at turn_starts; ValueError if a span's owners differ."""
    bounds = sample.turn_starts + [len(sample.response_ids)]
    out = []
    for start, stop in zip(bounds, bounds[1:]):
        owners = set(sample.token_owner[start:stop])
        if len(owners) != 1:
            raise ValueError(f"span {start}:{stop} has owners {owners}")
        out.append((owners.pop(), sample.response_ids[start:stop]))
    return out


def test_ownership_and_ids_against_the_template_by_hand(engine):
    tok = engine.tokenizer
    starts = _starts(tok)
    samples = _run(engine, starts=starts)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, j) for p in range(2) for j in range(3)]
    assert any(s.turns > 1 for s in samples), "the scripted environment should have answered at least once"
    for s in samples:
        start, label = starts[s.prompt_index], starts[s.prompt_index].row["label"]
        spans = _spans(s)
        assert [owner for owner, _ in spans] == [1, 0] * (s.turns - 1) + [1]  # policy, environment, ..., policy
        assert len(s.token_owner) == len(s.response_ids) == len(s.rollout_logprobs)
        context, reward = list(start.prompt_ids), 0.0
        for k, (owner, ids) in enumerate(spans):
            if owner == 1:  # the sampler's ids, kept exactly: a replay of the turn from the same context draws them
                turn = k // 2
                settings = SamplingSettings(n=1, max_new_tokens=5, temperature=1.0)
                replay = engine.generate([context], settings, [turn_seed(start.seed, s.sample_index, turn)])[0]
                assert replay.response_ids == ids
                words = tok.decode(ids, skip_special_tokens=True).split()
                reward += 1.0 if label in words else (0.0 if turn + 1 == GIVE_UP else -0.1)
            else:  # the environment's answer to policy turn k // 2 + 1, rendered by the template
                role = "user" if (k // 2) % 2 == 0 else "tool"
                assert ids == tok(f"{role} : say {label} now assistant : ", add_special_tokens=False)["input_ids"]
                assert s.rollout_logprobs[s.turn_starts[k]] == 0.0
            context += ids
        assert s.env_reward == pytest.approx(reward)
        assert (s.finish_reason, s.truncation) == ("stop", None)
        assert s.env_info == [{"step": t} for t in range(1, s.turns + 1)]  # every step's info, in order


def test_trainer_logprobs_agree_with_the_sampler_on_policy_tokens(engine, tiny_model_dir):
    samples = _run(engine)
    batch = ExperienceBatch.from_lists(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        [0.0] * len(samples),
        [[0.0] * len(s.response_ids) for s in samples],
        rollout_logprobs=[s.rollout_logprobs for s in samples],
        token_owner=[s.token_owner for s in samples],
    )
    model = load_policy(str(tiny_model_dir), "float32")
    with torch.no_grad():
        out = policy_forward(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, temperature=1.0
        )
    policy = batch.trained_mask.bool()
    assert int(policy.sum()) < int(batch.response_mask.sum())  # environment tokens are there, and left out
    torch.testing.assert_close(out.logprobs[policy], batch.rollout_logprobs[policy], atol=1e-4, rtol=0)


def test_turn_limit_is_a_recorded_truncation(engine):
    samples = _run(engine, env="NeverDoneEnv", limits=TurnLimits(2, 200))
    for s in samples:
        assert (s.finish_reason, s.truncation, s.turns, s.env_reward) == ("length", "max_turns", 2, 1.0)
        assert [owner for owner, _ in _spans(s)] == [1, 0, 1]


def test_token_limit_cuts_the_conversation(engine):
    # prompts of 5 and 5 tokens; 12 tokens in all leaves 7: a turn of at most 5, then the observation
    # ("user : now assistant :" = 5 tokens) does not fit with one more policy token.
    limits = TurnLimits(4, 12)
    for s in _run(engine, env="NeverDoneEnv", limits=limits):
        assert len(s.prompt_ids) + len(s.response_ids) <= 12
        assert (s.finish_reason, s.truncation) == ("length", "max_total_tokens")


def test_environment_first_message_replaces_the_prompt(engine):
    tok = engine.tokenizer
    for s in _run(engine, env="OwnPromptEnv"):
        label = "7" if s.prompt_index == 0 else "3"
        expected = f"user : please write digit {label} assistant : "
        assert s.prompt_text == expected
        assert s.prompt_ids == tok(expected, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "env, message",
    [
        ("RaisesOnSecondTurnEnv", r"\(row 5, sample 0\) turn 2: raised KeyError: 'scoreboard'"),
        ("WrongTypeEnv", r"\(row 5, sample 0\) turn 1: step returned dict"),
    ],
)
def test_bad_environment_is_named_with_row_and_turn(engine, env, message):
    with pytest.raises(EnvironmentFailed, match=rf"environment '{ENV}{env}' {message}"):
        _run(engine, env=env)


def test_the_readme_example_environment_runs(engine, tmp_path):
    """The example environment of docs/multi-turn.md 'Multi-turn rollouts', copied out of the page as it stands."""
    from tests.fixtures.docs import named_block

    (tmp_path / "my_env.py").write_text(named_block("guess-digit-env").text)
    factory = load_environment_factory(f"{tmp_path / 'my_env.py'}:GuessDigit")
    samples = run_conversations(
        engine, engine.tokenizer, factory, _starts(engine.tokenizer), SAMPLING, TurnLimits(4, 200)
    )
    tok = engine.tokenizer
    for s in samples:  # the example's rule, applied here to the policy's turns: +1 for the hit, else -0.1
        label = "7" if s.prompt_index == 0 else "3"
        replies = [tok.decode(ids, skip_special_tokens=True).split() for owner, ids in _spans(s) if owner == 1]
        expected = [1.0 if label in words else -0.1 for words in replies]
        assert 1.0 not in expected[:-1] and len(expected) == s.turns <= 3
        assert s.env_reward == pytest.approx(sum(expected))
        assert s.truncation is None  # the example ends every episode itself by turn 3


def test_a_token_limit_beyond_the_engines_context_is_refused_before_any_turn(engine):
    with pytest.raises(ValueError, match=r"max_total_tokens=1000 is more than the hf engine's context of 256"):
        _run(engine, limits=TurnLimits(4, 1000))


def test_the_template_suffix_after_a_reply_is_the_environments_less_the_eos_the_policy_sampled(engine):
    """A ChatML-like template in the tiny vocabulary: each message ends with "</s> now" (ChatML's "<|im_end|>\\n").
    A reply that stopped on EOS sampled "</s>" itself, so the environment's tokens start with "now"; a reply cut at
    max_new_tokens did not, so they start with "</s> now": either way the conversation is the template's."""
    import copy

    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> now {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    starts = []
    for index, prompt, label in ((5, "say 7 :", "7"), (9, "repeat 3 :", "3")):
        text = f"user : {prompt} </s> now assistant : "
        ids = tok(text, add_special_tokens=False)["input_ids"]
        starts.append(ConversationStart(index, {"prompt": prompt, "label": label}, prompt, text, ids, 1000 + index))
    factory = load_environment_factory(ENV + "DigitGuessEnv")
    # 16 conversations of replies up to 16 tokens: the random tiny model stops on EOS in some turns, not others
    sampling = SamplingSettings(n=8, max_new_tokens=16, temperature=1.0)
    samples = run_conversations(engine, tok, factory, starts, sampling, TurnLimits(4, 200))
    seen = set()
    for s in samples:
        spans, label = _spans(s), starts[s.prompt_index].row["label"]
        for k in range(1, len(spans), 2):
            reply, (owner, ids) = spans[k - 1][1], spans[k]
            stopped = reply[-1] == tok.eos_token_id
            seen.add(stopped)
            role = "user" if (k // 2) % 2 == 0 else "tool"
            text = ("" if stopped else "</s> ") + f"now {role} : say {label} now </s> now assistant : "
            assert owner == 0 and ids == tok(text, add_special_tokens=False)["input_ids"], (stopped, tok.decode(ids))
    assert seen == {True, False}, "both kinds of reply should occur"
