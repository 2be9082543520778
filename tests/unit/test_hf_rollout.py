"""HFRolloutEngine: shapes and order, finish reasons, per-prompt seeds, log-probs vs a plain forward."""
import pytest
import torch

from engines.models import load_policy
from engines.rollout.base import RolloutEngine, SamplingSettings
from engines.rollout.hf import HFRolloutEngine, warp_scores

PROMPTS = [[1, 14, 7, 21], [1, 15, 9, 21, 30, 31], [1, 16]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFRolloutEngine(str(tiny_model_dir), seed=0, max_batch_size=4)


def test_implements_the_protocol_with_ordered_samples(engine):
    assert isinstance(engine, RolloutEngine) and engine.name == "hf"
    samples = engine.generate(PROMPTS, SamplingSettings(n=3, max_new_tokens=6), seeds=[1, 2, 3])
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(3) for j in range(3)]
    for s in samples:
        assert s.prompt_ids == PROMPTS[s.prompt_index]
        assert 1 <= len(s.response_ids) <= 6 and len(s.rollout_logprobs) == len(s.response_ids)
        assert all(lp <= 0 for lp in s.rollout_logprobs)


def test_finish_reasons(engine, tiny_model_dir):
    eos = engine.tokenizer.eos_token_id
    samples = engine.generate(PROMPTS * 4, SamplingSettings(n=2, max_new_tokens=5), seeds=list(range(12)))
    for s in samples:
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == eos and eos not in s.response_ids[:-1]
        else:
            assert len(s.response_ids) == 5 and eos not in s.response_ids
    # Every token as a stop token: each response stops after exactly one token.
    stop_all = SamplingSettings(n=2, max_new_tokens=5, stop_token_ids=tuple(range(64)))
    assert all(len(s.response_ids) == 1 and s.finish_reason == "stop" for s in engine.generate(PROMPTS, stop_all))


def test_seeds_fix_samples_whatever_the_batch(engine):
    sampling = SamplingSettings(n=2, max_new_tokens=6)
    together = engine.generate(PROMPTS, sampling, seeds=[11, 12, 13])
    # Prompt 1 alone, in a batch of a different width and size (max_batch_size splits the 6 rows above).
    alone = engine.generate([PROMPTS[1]], sampling, seeds=[12])
    assert [s.response_ids for s in alone] == [s.response_ids for s in together if s.prompt_index == 1]
    other = engine.generate([PROMPTS[1]], sampling, seeds=[99])
    assert [s.response_ids for s in other] != [s.response_ids for s in alone]
    # Unseeded calls differ from each other (the engine advances its call counter).
    assert engine.generate(PROMPTS, sampling) != engine.generate(PROMPTS, sampling)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 5, 0.9)])
def test_logprobs_equal_a_plain_forward_at_the_temperature(engine, tiny_model_dir, temperature, top_k, top_p):
    sampling = SamplingSettings(n=2, max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p)
    samples = engine.generate(PROMPTS, sampling, seeds=[4, 5, 6])
    model = load_policy(tiny_model_dir).eval()
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(s.response_ids)[:, None])
        # Full-vocabulary log-probs, NOT renormalised after top-k/top-p. Tolerance: the sampler ran a
        # left-padded batch with a KV cache, this forward one unpadded row: fp32 reassociation only
        # (~1e-6 on logits of size ~1); 1e-4 is far below the 0.1-scale effect truncation would have.
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), expected[:, 0], atol=1e-4, rtol=0)


def test_top_k_top_p_restrict_the_support(engine):
    samples = engine.generate(PROMPTS, SamplingSettings(n=4, max_new_tokens=4, top_k=1), seeds=[1, 2, 3])
    by_prompt = {}
    for s in samples:  # top_k=1 is greedy: all samples of a prompt are equal
        by_prompt.setdefault(s.prompt_index, set()).add(tuple(s.response_ids))
    assert all(len(v) == 1 for v in by_prompt.values())
    # top_p: probabilities 0.5, 0.3, 0.2 -> top_p=0.6 keeps the two tokens whose preceding mass < 0.6.
    scores = warp_scores(torch.log(torch.tensor([[0.5, 0.3, 0.2]])), 1.0, -1, 0.6)
    assert torch.isfinite(scores).tolist() == [[True, True, False]]


def test_errors_name_the_prompt(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], SamplingSettings())
    with pytest.raises(ValueError, match=r"prompt 0 has 250 tokens.*256 positions"):
        engine.generate([[1] * 250], SamplingSettings(max_new_tokens=16))


def test_load_weights_switches_model_and_version(engine, tiny_model_dir, tmp_path):
    from engines.toy.model import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", seed=7)
    sampling = SamplingSettings(n=1, max_new_tokens=6)
    before = engine.generate(PROMPTS, sampling, seeds=[1, 2, 3])
    engine.load_weights(str(other), version=5)
    after = engine.generate(PROMPTS, sampling, seeds=[1, 2, 3])
    assert {s.policy_version for s in after} == {5}
    assert [s.rollout_logprobs for s in after] != [s.rollout_logprobs for s in before]
    engine.load_weights(str(tiny_model_dir), version=0)
