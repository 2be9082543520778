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
            logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1]
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


def test_inverse_cdf_sample_matches_the_probabilities_by_hand():
    from engines.rollout.hf import inverse_cdf_sample

    # Unnormalised row (total 2): tokens 0 and 2 have no mass, token 1 has 1/4, token 3 has 3/4.
    probs = torch.tensor([[0.0, 0.5, 0.0, 1.5]])
    grid = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000  # evenly spread uniforms
    drawn = torch.stack([inverse_cdf_sample(probs, u.reshape(1)) for u in grid]).flatten()
    assert torch.bincount(drawn, minlength=4).tolist() == [0, 250, 0, 750]
    # The ends of [0, 1): u = 0 and the float just below 1 still land on tokens with mass.
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    assert inverse_cdf_sample(probs, torch.tensor([0.0])).tolist() == [1]
    assert inverse_cdf_sample(probs, below_one.reshape(1)).tolist() == [3]
    # Rows are independent: each row reads its own uniform.
    two = inverse_cdf_sample(torch.tensor([[1.0, 1.0], [1.0, 1.0]]), torch.tensor([0.25, 0.75]))
    assert two.tolist() == [0, 1]


def test_first_token_frequencies_follow_the_model(engine, tiny_model_dir):
    """4000 one-token samples of one prompt at temperature 0.1 against softmax(logits / 0.1) of a plain forward."""
    n = 4000
    sampling = SamplingSettings(n=n, max_new_tokens=1, temperature=0.1)
    samples = engine.generate([PROMPTS[0]], sampling, seeds=[17])
    model = load_policy(tiny_model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    probs = torch.softmax(logits / 0.1, -1)
    counts = torch.bincount(torch.tensor([s.response_ids[0] for s in samples]), minlength=probs.numel())
    total_variation = 0.5 * (counts / n - probs).abs().sum().item()
    # Sampling noise alone: E[TV] ~ 0.8 * 0.5 * sum sqrt(p (1 - p) / n) ~ 0.03 here; a sampler that ignored the
    # temperature or drew uniformly would sit above 0.3 from this peaked distribution (checked below).
    assert total_variation < 0.1
    assert 0.5 * (torch.full_like(probs, 1 / probs.numel()) - probs).abs().sum().item() > 0.3
    assert 0.5 * (torch.softmax(logits, -1) - probs).abs().sum().item() > 0.3


def test_load_weights_copies_a_same_architecture_folder_in_place(tiny_model_dir, tmp_path):
    from engines.toy.model import build_tiny_llama

    engine = HFRolloutEngine(str(tiny_model_dir), seed=0)
    model_before = engine.model
    other = build_tiny_llama(tmp_path / "other", seed=7)
    engine.load_weights(str(other), version=3)
    assert engine.model is model_before  # copied into the loaded model, not rebuilt
    expected = load_policy(other).state_dict()
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # Another architecture cannot be copied in place: the model is rebuilt and serves the new shape.
    wider = build_tiny_llama(tmp_path / "wider", hidden_size=256, num_heads=4, seed=1)
    engine.load_weights(str(wider), version=4)
    assert engine.model is not model_before and engine.model.config.hidden_size == 256
    assert len(engine.generate(PROMPTS, SamplingSettings(max_new_tokens=3), seeds=[1, 2, 3])) == 3


def test_load_state_dict_serves_the_same_samples_as_the_saved_folder(tiny_model_dir, tmp_path):
    from engines.toy.model import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", seed=11)
    sampling = SamplingSettings(n=2, max_new_tokens=6)
    from_folder = HFRolloutEngine(str(other), seed=0).generate(PROMPTS, sampling, seeds=[1, 2, 3])
    engine = HFRolloutEngine(str(tiny_model_dir), seed=0)
    engine.load_state_dict(load_policy(other).state_dict(), version=9)
    in_memory = engine.generate(PROMPTS, sampling, seeds=[1, 2, 3])
    assert [s.response_ids for s in in_memory] == [s.response_ids for s in from_folder]
    assert {s.policy_version for s in in_memory} == {9}
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        engine.load_state_dict({k: v for k, v in load_policy(other).state_dict().items() if k != "lm_head.weight"}, 10)


def test_bfloat16_autocast_generation_stays_within_bf16_rounding(tiny_model_dir):
    sampling = SamplingSettings(n=2, max_new_tokens=6)
    engine = HFRolloutEngine(str(tiny_model_dir), seed=0, autocast_dtype="bfloat16")
    samples = engine.generate(PROMPTS, sampling, seeds=[4, 5, 6])
    model = load_policy(tiny_model_dir).eval()
    gaps = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        gaps.append((torch.tensor(s.rollout_logprobs) - expected).abs().max().item())
    # bf16 keeps 8 bits of mantissa: logits of size ~1 move by ~1e-2; float32 would agree to ~1e-6.
    assert max(gaps) < 0.1 and max(gaps) > 1e-5


def test_autocast_engine_keeps_linear_weights_in_bf16_through_every_load(tiny_model_dir, tmp_path):
    from engines.toy.model import build_tiny_llama

    engine = HFRolloutEngine(str(tiny_model_dir), seed=0, autocast_dtype="bfloat16")

    def assert_serves(folder):
        expected = load_policy(folder).state_dict()
        for name, tensor in engine.model.state_dict().items():
            linear = name.endswith("_proj.weight") or name == "lm_head.weight"
            assert tensor.dtype == (torch.bfloat16 if linear else torch.float32), name
            assert torch.equal(tensor, expected[name].to(tensor.dtype)), name

    assert_serves(tiny_model_dir)
    other = build_tiny_llama(tmp_path / "other", seed=5)
    engine.load_weights(str(other), version=1)  # in place: float32 file values rounded into bf16 storage
    assert_serves(other)
    engine.load_state_dict(load_policy(tiny_model_dir).state_dict(), version=2)
    assert_serves(tiny_model_dir)
