"""selective_log_softmax and entropy_from_logits against the naive full-vocabulary computation.

Tolerances: fp32 log-probs of size ~|log V| ~ 10 carry rounding of a few ulp (1 ulp at 10 is 1e-6), so
1e-5 is the issue's bar and leaves room for the different summation order of logsumexp vs log_softmax.
Gradients are (1[v = y] - p) * upstream / tau, up to ~3 in size: rtol 1e-5 (~100 fp32 ulp) + atol 1e-6.
float64 gradcheck is the independent check of the hand-written backward (finite differences).
"""

import math

import pytest
import torch

from engines.ppo.logprobs import entropy_from_logits, selective_log_softmax, selective_log_softmax_and_entropy


def naive_logprobs(logits, token_ids, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, token_ids[..., None]).squeeze(-1)


def naive_entropy(logits, temperature=1.0, dtype=torch.float32):
    scaled = logits.to(dtype) / temperature
    return -(scaled.softmax(-1) * scaled.log_softmax(-1)).sum(-1)


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(0)
    # scale 4: peaked rows like a trained LM's, where a naive exp() without max-subtraction would overflow
    logits = 4 * torch.randn(3, 7, 1000, generator=generator)
    token_ids = torch.randint(0, 1000, (3, 7), generator=generator)
    return logits, token_ids


class TestSelectiveLogSoftmax:
    @pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
    # chunk_size counts token rows of the flattened B * T = 21: 5, 8 and 12 do not divide 21, so
    # blocks straddle sequence boundaries and the last one is shorter; 256 is one block
    @pytest.mark.parametrize("chunk_size", [1, 3, 5, 8, 12, 256])
    def test_equals_naive_fp32(self, batch, temperature, chunk_size):
        logits, token_ids = batch
        got = selective_log_softmax(logits, token_ids, temperature, chunk_size)
        assert got.dtype == torch.float32 and got.shape == (3, 7)
        torch.testing.assert_close(got, naive_logprobs(logits, token_ids, temperature), rtol=0, atol=1e-5)

    @pytest.mark.parametrize("chunk_size", [2, 3, 5])  # B = 1: chunks of 2, 3, 5 positions over T = 7
    def test_single_sequence_uneven_chunks(self, batch, chunk_size):
        logits, token_ids = batch[0][:1], batch[1][:1]
        weights = logits.clone().requires_grad_()
        got = selective_log_softmax(weights, token_ids, 1.1, chunk_size)
        torch.testing.assert_close(got, naive_logprobs(logits, token_ids, 1.1), rtol=0, atol=1e-5)
        got.sum().backward()
        reference = logits.clone().requires_grad_()
        naive_logprobs(reference, token_ids, 1.1).sum().backward()
        torch.testing.assert_close(weights.grad, reference.grad, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("temperature", [1.0, 0.6])
    def test_gradient_equals_naive(self, batch, temperature):
        logits, token_ids = batch
        upstream = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
        ours = logits.clone().requires_grad_()
        (selective_log_softmax(ours, token_ids, temperature, chunk_size=4) * upstream).sum().backward()
        reference = logits.clone().requires_grad_()
        (naive_logprobs(reference, token_ids, temperature) * upstream).sum().backward()
        torch.testing.assert_close(ours.grad, reference.grad, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("contiguous", [True, False])
    def test_inplace_backward_gives_the_same_gradient(self, batch, dtype, contiguous):
        logits, token_ids = batch
        upstream = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
        grads = []
        for inplace in (False, True):
            model_output = logits.to(dtype).requires_grad_()
            # a non-leaf like lm_head's output; sliced after the op it is a strided view
            shifted = model_output[:, :-1] * 1.0 if contiguous else (model_output * 1.0)[:, :-1]
            logprobs = selective_log_softmax(shifted, token_ids[:, 1:], 0.8, 5, inplace_backward=inplace)
            (logprobs * upstream).sum().backward()
            grads.append(model_output.grad.float())
        assert torch.equal(grads[0], grads[1])  # same arithmetic, only the destination differs

    def test_inplace_backward_misuse_fails_loudly(self, batch):
        logits, token_ids = batch
        shared = logits.clone().requires_grad_() * 1.0
        entropy = entropy_from_logits(shared).sum()  # also needs `shared`; its backward runs later
        logprobs = selective_log_softmax(shared, token_ids, inplace_backward=True).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (logprobs + entropy).backward()

    def test_gradcheck_float64(self):
        logits = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
        token_ids = torch.randint(0, 6, (2, 5))
        assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, token_ids, 0.8, 3), (logits,))

    def test_hand_example(self):
        # logits [0, ln 3] -> softmax [1/4, 3/4]: log p(1) = ln 0.75, log p(0) = ln 0.25.
        logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
        got = selective_log_softmax(logits, torch.tensor([[1, 0]]))
        torch.testing.assert_close(got, torch.tensor([[math.log(0.75), math.log(0.25)]]))
        # temperature 0.5 doubles the logits: [0, ln 9] -> p(1) = 9/10
        hot = selective_log_softmax(logits, torch.tensor([[1, 1]]), temperature=0.5)
        torch.testing.assert_close(hot, torch.full((1, 2), math.log(0.9)))

    def test_bf16_logits_upcast(self, batch):
        logits, token_ids = batch
        low = logits.to(torch.bfloat16)
        got = selective_log_softmax(low, token_ids, 0.9, chunk_size=5)
        assert got.dtype == torch.float32
        # the bf16 values upcast exactly to fp32, so the fp32 naive result on them is the reference
        torch.testing.assert_close(got, naive_logprobs(low.float(), token_ids, 0.9), rtol=0, atol=1e-5)
        grad_in = low.clone().requires_grad_()
        selective_log_softmax(grad_in, token_ids).sum().backward()
        assert grad_in.grad.dtype == torch.bfloat16 and torch.isfinite(grad_in.grad.float()).all()

    @pytest.mark.parametrize("chunk_size", [2, 4, 64])  # per-sequence blocks: 4 does not divide T = 6
    def test_non_contiguous_shifted_logits(self, batch, chunk_size):
        logits, token_ids = batch
        shifted = logits[:, :-1]  # how a trainer slices model logits: a strided view, not a copy
        assert not shifted.is_contiguous()
        got = selective_log_softmax(shifted, token_ids[:, 1:], chunk_size=chunk_size)
        torch.testing.assert_close(got, naive_logprobs(shifted, token_ids[:, 1:]), rtol=0, atol=1e-5)
        torch.testing.assert_close(
            entropy_from_logits(shifted, 1.0, chunk_size),
            naive_entropy(shifted, 1.0, torch.float64).float(),
            rtol=0,
            atol=1e-5,
        )

    def test_no_grad_input_gives_no_graph(self, batch):
        logits, token_ids = batch
        assert not selective_log_softmax(logits, token_ids).requires_grad

    def test_out_of_vocabulary_id_is_named(self, batch):
        logits, token_ids = batch
        bad = token_ids.clone()
        bad[1, 4] = 1000
        with pytest.raises(ValueError, match=r"token_ids\[1, 4\] = 1000 .*\[0, 1000\)"):
            selective_log_softmax(logits, bad)

    @pytest.mark.parametrize(
        "kwargs, message",
        [
            ({"temperature": 0.0}, "temperature"),
            ({"chunk_size": 0}, "chunk_size"),
        ],
    )
    def test_bad_settings(self, batch, kwargs, message):
        logits, token_ids = batch
        with pytest.raises(ValueError, match=message):
            selective_log_softmax(logits, token_ids, **kwargs)

    def test_shape_mismatch(self, batch):
        logits, token_ids = batch
        with pytest.raises(ValueError, match="token_ids has shape"):
            selective_log_softmax(logits, token_ids[:, :-1])
        with pytest.raises(ValueError, match=r"logits must have shape \(B, T, V\)"):
            selective_log_softmax(logits[0], token_ids[0])


class TestEntropyFromLogits:
    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    @pytest.mark.parametrize("chunk_size", [1, 4, 256])
    def test_equals_naive(self, batch, temperature, chunk_size):
        logits, _ = batch
        got = entropy_from_logits(logits, temperature, chunk_size)
        # float64 reference: the fp32 naive form itself is off by a few 1e-6 on these peaked rows
        reference = naive_entropy(logits, temperature, torch.float64).float()
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)

    def test_gradient_equals_naive(self, batch):
        logits, _ = batch
        upstream = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
        ours = logits.clone().requires_grad_()
        (entropy_from_logits(ours, 0.8, chunk_size=5) * upstream).sum().backward()
        reference = logits.clone().requires_grad_()
        (naive_entropy(reference, 0.8) * upstream).sum().backward()
        torch.testing.assert_close(ours.grad, reference.grad, rtol=1e-5, atol=1e-6)

    def test_gradcheck_float64(self):
        logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 1.3, 2), (logits,))

    def test_uniform_and_peaked(self):
        # uniform over V = 8 -> ln 8; one logit 50 above the rest -> p(other) ~ e^-50, entropy ~ 0
        uniform = torch.zeros(1, 2, 8)
        torch.testing.assert_close(entropy_from_logits(uniform), torch.full((1, 2), math.log(8.0)))
        peaked = torch.zeros(1, 1, 8)
        peaked[..., 3] = 50.0
        assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-15)


class TestLogSoftmaxAndEntropy:
    """selective_log_softmax_and_entropy: the log-probs of selective_log_softmax and the entropy metric, one pass."""

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    @pytest.mark.parametrize("chunk_size", [1, 5, 256])
    def test_both_equal_naive(self, batch, temperature, chunk_size):
        logits, token_ids = batch
        logprobs, entropy = selective_log_softmax_and_entropy(logits, token_ids, temperature, chunk_size)
        assert logprobs.shape == entropy.shape == (3, 7)
        torch.testing.assert_close(logprobs, naive_logprobs(logits, token_ids, temperature), rtol=0, atol=1e-5)
        torch.testing.assert_close(
            entropy, naive_entropy(logits, temperature, torch.float64).float(), rtol=0, atol=1e-5
        )

    def test_entropy_is_the_separate_functions_exactly(self, batch):
        # the same block arithmetic as entropy_from_logits: a run's entropy metric does not move by a bit
        logits, token_ids = batch
        logprobs, entropy = selective_log_softmax_and_entropy(logits, token_ids, 0.7, 5)
        assert torch.equal(entropy, entropy_from_logits(logits, 0.7, 5))
        assert torch.equal(logprobs, selective_log_softmax(logits, token_ids, 0.7, 5))

    def test_hand_example(self):
        # logits [0, ln 3] -> p = [1/4, 3/4]: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623...
        logits = torch.tensor([[[0.0, math.log(3.0)]]])
        logprobs, entropy = selective_log_softmax_and_entropy(logits, torch.tensor([[1]]))
        expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
        torch.testing.assert_close(entropy, torch.tensor([[expected]]))
        torch.testing.assert_close(logprobs, torch.tensor([[math.log(0.75)]]))

    @pytest.mark.parametrize("inplace", [False, True])
    def test_gradient_is_the_log_probs_only(self, batch, inplace):
        # the entropy carries no gradient: the logits' gradient is the log-probs' alone, in place or not
        logits, token_ids = batch
        upstream = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
        model_output = logits.clone().requires_grad_()
        logprobs, entropy = selective_log_softmax_and_entropy(model_output * 1.0, token_ids, 0.9, 4, inplace)
        assert not entropy.requires_grad
        (logprobs * upstream + entropy).sum().backward()
        reference = logits.clone().requires_grad_()
        (naive_logprobs(reference, token_ids, 0.9) * upstream).sum().backward()
        torch.testing.assert_close(model_output.grad, reference.grad, rtol=1e-5, atol=1e-6)

    def test_bad_input_is_named(self, batch):
        logits, token_ids = batch
        with pytest.raises(ValueError, match="token_ids must be logits.shape"):
            selective_log_softmax_and_entropy(logits, token_ids[:, :3])
