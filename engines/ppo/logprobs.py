"""Log-probabilities and entropies of a causal LM's logits without a full-vocabulary log-softmax tensor.

Notation: B = sequences, T = positions, V = vocabulary. `logits[b, t]` scores the token at position t
(the caller has already shifted: logits of position t predict token_ids[b, t]). tau = sampling
temperature; z = logits / tau.

    log p(y_t) = z[y_t] - logsumexp_v z[v]                     (selective log-softmax)
    H_t        = -sum_v p(v) log p(v)                         (entropy)

Both are computed chunk by chunk over positions (torch's fused log_softmax on one chunk, then a
gather), so at most about `chunk_size` x V floats of working memory exist at a time instead of the
B x T x V log-softmax that `log_softmax(...).gather(...)` builds (4.2 GB for 32 sequences of 1024
tokens at V = 32000 in fp32). The backward passes are written out
(custom autograd Functions) for the same reason: plain autograd would keep every chunk's softmax alive
until backward. Only the inputs and (B, T) statistics are saved; the backward recomputes each chunk.

The temperature is applied the way samplers (vLLM, HF generate) apply it: logits divided by tau before
the softmax, so these log-probs match the sampler's `rollout_logprobs`.

bf16/fp16 logits are upcast one chunk at a time; results are float32 (float64 for float64 logits).
Double backward is not supported (PPO never needs it).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from engines.ppo._checks import check_rank


def _row_blocks(logits: Tensor, chunk_size: int) -> list[tuple[int, int, Tensor]]:
    """Split (B, T, V) logits into blocks of at most `chunk_size` token rows, each a (n, V) view.

    Returns (start, end, block) with [start, end) indexing the flattened B * T positions. Blocks are
    views, never copies, and contiguous whenever each sequence's rows are (the usual case, including
    the shifted slice logits[:, :-1]), so torch's kernels do not copy them either: a plain
    logits[:, s:e] chunk is strided across the batch for B > 1 and log_softmax copied it.
    """
    batch, length, vocab = logits.shape
    try:
        flat = logits.view(batch * length, vocab)  # contiguous logits: blocks may span sequences
        segments = [(0, flat)]
    except RuntimeError:  # e.g. logits[:, :-1]: rows are adjacent only within one sequence
        segments = [(b * length, logits[b]) for b in range(batch)]
    blocks = []
    for offset, rows in segments:
        for start in range(0, rows.shape[0], chunk_size):
            end = min(start + chunk_size, rows.shape[0])
            blocks.append((offset + start, offset + end, rows[start:end]))
    return blocks


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _scaled(chunk: Tensor, temperature: float, dtype: torch.dtype, out: Optional[Tensor] = None) -> Tensor:
    """z = chunk / tau in the compute dtype. No copy for fp32 logits at tau = 1. `out`: an (n, V) buffer of the
    compute dtype to write z into instead of a new tensor (the same numbers)."""
    scaled = chunk.to(dtype)
    if temperature == 1.0:
        return scaled
    return scaled / temperature if out is None else torch.div(scaled, temperature, out=out)


def _block_entropy(log_probs: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """-sum_v p(v) log p(v) of an (n, V) block of log-probabilities: (n,). The one formula both entropy paths use,
    so the metric from the log-probs' pass equals entropy_from_logits bit for bit. `out`: an (n, V) buffer for p
    instead of a new tensor (its contents are overwritten)."""
    probs = torch.exp(log_probs) if out is None else torch.exp(log_probs, out=out)
    return -probs.mul_(log_probs).sum(-1)


def _block_buffers(logits: Tensor, blocks: list, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Two (rows of the largest block, V) buffers of the compute dtype, reused by every block of a forward: one for
    log p, one for z = logits / tau and then p. A new (n, V) tensor per block cost its page faults (SmolLM2: 25 MB a
    block; in torch.profiler on train_on the division and exp() that wrote new tensors took 2-3x the log_softmax's
    own time), and torch's fused log_softmax is ~2x faster than logsumexp + gather on CPU."""
    rows = max((end - start for start, end, _ in blocks), default=0)
    return tuple(logits.new_empty((rows, logits.shape[-1]), dtype=dtype) for _ in range(2))


def _grad_destination(logits: Tensor, inplace: bool):
    """Where the backward writes: the logits' own blocks (in place) or a new contiguous (B*T, V) tensor.

    Returns (tensor to hand to autograd, function (start, end, logits_block) -> destination block).
    """
    if inplace:
        return logits, lambda start, end, block: block
    grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat = grad_logits.view(-1, logits.shape[-1])
    return grad_logits, lambda start, end, block: flat[start:end]


def _softmax_grad_into(
    out: Tensor, logits_block: Tensor, logsumexp: Tensor, token_ids: Tensor, upstream: Tensor, tau: float
) -> None:
    """out <- (1[v == y] - softmax(logits_block / tau)[v]) * upstream / tau. Shapes (n, V), (n, 1).

    `out` may be `logits_block` itself (in-place backward). fp32/fp64 work directly in `out` with no
    temporary; lower precisions compute in fp32 and round once at the end (bf16 exp() of bf16
    differences would lose ~2 significant digits of every probability).
    """
    if out.dtype in (torch.float32, torch.float64):
        work = out
        if out.data_ptr() != logits_block.data_ptr() or out.stride() != logits_block.stride():
            work.copy_(logits_block)
    else:
        work = logits_block.to(logsumexp.dtype, copy=True)
    if tau != 1.0:
        work.div_(tau)
    work.sub_(logsumexp).exp_().mul_(-upstream)  # -p * g
    work.scatter_add_(-1, token_ids, upstream)  # + 1[v == y] * g
    if tau != 1.0:
        work.div_(tau)
    if work is not out:
        out.copy_(work)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """d log p(y) / d logits[v] = (1[v == y] - p(v)) / tau, recomputed per block in backward."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        token_ids: Tensor,
        temperature: float,
        chunk_size: int,
        inplace_backward: bool,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(logits)
        flat_ids = token_ids.reshape(-1, 1)
        logprobs = torch.empty(flat_ids.shape[0], dtype=dtype, device=logits.device)
        logsumexp = torch.empty_like(logprobs)
        # the entropy metric from the same log-softmax block (_ChunkedEntropy's sum, without its second pass over
        # the vocabulary); empty when not asked for. It carries no gradient.
        entropy = torch.empty(flat_ids.shape[0] if with_entropy else 0, dtype=dtype, device=logits.device)
        blocks = _row_blocks(logits, chunk_size)
        buffer, work = _block_buffers(logits, blocks, dtype)  # log p; z, then p
        for start, end, block in blocks:
            n = end - start
            z = _scaled(block, temperature, dtype, out=work[:n])
            block_logprobs = torch.log_softmax(z, dim=-1, out=buffer[:n])
            chosen_ids = flat_ids[start:end]
            chosen = block_logprobs.gather(-1, chosen_ids).squeeze(-1)
            logprobs[start:end] = chosen
            # log p(y) = z[y] - logsumexp(z), so the backward's logsumexp comes free from the gather
            logsumexp[start:end] = z.gather(-1, chosen_ids).squeeze(-1) - chosen
            if with_entropy:  # z is spent: its buffer takes p
                entropy[start:end] = _block_entropy(block_logprobs, out=work[:n])
        ctx.save_for_backward(logits, flat_ids, logsumexp)
        ctx.temperature, ctx.chunk_size, ctx.inplace_backward = temperature, chunk_size, inplace_backward
        entropy = entropy.view(token_ids.shape) if with_entropy else entropy
        ctx.mark_non_differentiable(entropy)  # the returned tensor itself: a view of a marked one is not marked
        return logprobs.view(token_ids.shape), entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs: Tensor, _grad_entropy: Tensor):
        logits, flat_ids, logsumexp = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        # In place: the writes bump the logits' version counter, so any other autograd node that saved
        # these logits fails loudly ("modified by an inplace operation") instead of reading gradients.
        grad_logits, destination = _grad_destination(logits, ctx.inplace_backward)
        upstream = grad_logprobs.reshape(-1, 1).to(logsumexp.dtype)
        for start, end, block in _row_blocks(logits, ctx.chunk_size):
            _softmax_grad_into(
                destination(start, end, block),
                block,
                logsumexp[start:end, None],
                flat_ids[start:end],
                upstream[start:end],
                ctx.temperature,
            )
        return grad_logits, None, None, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    """H = -sum_v p(v) log p(v); dH / dz[v] = -p(v) (log p(v) + H); dz/dlogits = 1/tau.

    Summing p * log p (all terms of one sign) rather than computing logsumexp - E_p[z] avoids the
    cancellation of two numbers of size |z| (~15 for peaked rows), which cost 2e-5 in fp32.
    Saves logsumexp and H, both (B * T,); the backward recomputes log p per block.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
        dtype = _compute_dtype(logits)
        entropy = torch.empty(logits.shape[0] * logits.shape[1], dtype=dtype, device=logits.device)
        logsumexp = torch.empty_like(entropy)
        blocks = _row_blocks(logits, chunk_size)
        buffer, work = _block_buffers(logits, blocks, dtype)  # log p; z, then p
        for start, end, block in blocks:
            n = end - start
            z = _scaled(block, temperature, dtype, out=work[:n])
            log_probs = torch.log_softmax(z, dim=-1, out=buffer[:n])  # fused kernel; logsumexp = z - log p anywhere
            logsumexp[start:end] = z[:, 0] - log_probs[:, 0]  # before p overwrites z
            entropy[start:end] = _block_entropy(log_probs, out=work[:n])
        ctx.save_for_backward(logits, logsumexp, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return entropy.view(logits.shape[:2])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_entropy: Tensor):
        logits, logsumexp, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        tau = ctx.temperature
        grad_logits, destination = _grad_destination(logits, inplace=False)
        upstream = grad_entropy.reshape(-1, 1).to(logsumexp.dtype)
        for start, end, block in _row_blocks(logits, ctx.chunk_size):
            log_probs = _scaled(block, tau, logsumexp.dtype).sub(logsumexp[start:end, None])
            probs = torch.exp(log_probs)
            centred = log_probs.add_(entropy[start:end, None])  # log p + H = z - E_p[z]
            destination(start, end, block).copy_(probs.mul_(centred).mul_(-upstream[start:end] / tau))
        return grad_logits, None, None


def _check_common(logits: Tensor, temperature: float, chunk_size: int) -> None:
    check_rank("logits", logits, 3, "(B, T, V)")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")


def selective_log_softmax(
    logits: Tensor, token_ids: Tensor, temperature: float = 1.0, chunk_size: int = 128, inplace_backward: bool = False
) -> Tensor:
    """Log-probability of each chosen token, log softmax(logits / temperature)[token], chunked.

    Args:
        logits: Shape (B, T, V), any float dtype; row t predicts token_ids[:, t] (already shifted).
        token_ids: Shape (B, T), integer ids in [0, V). Padding positions need a valid id too (any,
            e.g. the pad id): their log-probs are computed and the caller masks them out.
        temperature: the sampler's temperature tau (> 0); logits are divided by it first.
        chunk_size: token rows (positions, over all sequences) materialised at once; working memory
            is about chunk_size x V floats. Smaller saves memory, larger cuts per-chunk overhead.
            bench.logprobs (V = 32000, 1024 tokens, CPU fp32, forward): 128 uses 0.16x the naive
            peak memory (0.08x at 2 x 1024 tokens) at ~0.38x its time; 64 and 256 are as fast, 512
            is slower (0.69x).
        inplace_backward: write the gradient into the logits' own storage instead of a new (B, T, V)
            tensor (saves one B x T x V buffer in backward, a third of the naive peak). Only when
            nothing else needs these logits' values after the backward: the model's lm_head does
            not (its backward needs its input), but an entropy bonus computed from the same logits
            tensor does -- autograd then raises "modified by an inplace operation" (loud, not wrong).

    Returns:
        Shape (B, T), float32 (float64 for float64 logits). Differentiable with respect to `logits`.

    Raises:
        ValueError / TypeError naming the argument for wrong ranks, shapes, dtypes, ids outside
        [0, V), temperature <= 0 or chunk_size < 1.
    """
    _check_token_ids(logits, token_ids, temperature, chunk_size)
    out = _SelectiveLogSoftmax.apply(
        logits, token_ids.long(), float(temperature), chunk_size, bool(inplace_backward), False
    )
    return out[0]


def selective_log_softmax_and_entropy(
    logits: Tensor, token_ids: Tensor, temperature: float = 1.0, chunk_size: int = 128, inplace_backward: bool = False
) -> tuple[Tensor, Tensor]:
    """selective_log_softmax's log-probs and, from the same pass over the vocabulary, the entropy metric.

    The log-probs are exactly selective_log_softmax's (differentiable w.r.t. `logits`); the entropy (B, T) equals
    entropy_from_logits(logits.detach(), ...) and carries no gradient: what the update logs when the entropy is not in
    its loss. One log-softmax per block instead of two, and since no other autograd node then saves these logits, the
    caller may pass inplace_backward=True. Arguments, shapes and errors as selective_log_softmax's.
    """
    _check_token_ids(logits, token_ids, temperature, chunk_size)
    return _SelectiveLogSoftmax.apply(
        logits, token_ids.long(), float(temperature), chunk_size, bool(inplace_backward), True
    )


def _check_token_ids(logits: Tensor, token_ids: Tensor, temperature: float, chunk_size: int) -> None:
    """selective_log_softmax's argument checks (its docstring's Raises)."""
    _check_common(logits, temperature, chunk_size)
    check_rank("token_ids", token_ids, 2, "(B, T)")
    if token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_ids has shape {tuple(token_ids.shape)} but logits has "
            f"{tuple(logits.shape)}; token_ids must be logits.shape[:2]"
        )
    if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
        raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    vocab = logits.shape[-1]
    if token_ids.numel():
        bad = (token_ids < 0) | (token_ids >= vocab)
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"token_ids[{b}, {t}] = {int(token_ids[b, t])} is outside the vocabulary [0, {vocab}) of logits"
            )


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = 128) -> Tensor:
    """Entropy of softmax(logits / temperature) at every position, chunked like selective_log_softmax.

    Args:
        logits: Shape (B, T, V), finite values (a -inf logit makes p * z undefined); any float dtype.
        temperature: tau > 0, as in selective_log_softmax.
        chunk_size: token rows (positions, over all sequences) materialised at once.

    Returns:
        Shape (B, T) in nats, float32 (float64 for float64 logits); differentiable w.r.t. `logits`.
        Padding positions are computed too; mask them with the response mask (1 = response token).
    """
    _check_common(logits, temperature, chunk_size)
    return _ChunkedEntropy.apply(logits, float(temperature), chunk_size)
