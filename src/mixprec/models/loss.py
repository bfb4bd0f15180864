"""Cross-entropy over a large vocabulary without the full logits.

The plain loss keeps the FP32 logits of a micro-batch alive from forward to backward:
for a 128,256-token vocabulary and 8,192 tokens that is 8192 x 128256 x 4 B = 4.2 GB,
plus their low-precision copy and their gradient. `chunked_cross_entropy` takes the
output projection and the loss together, a chunk of tokens at a time, and computes the
gradients of the hidden states and of the weight in the same pass (no recompute: the
three GEMMs of the plain forward and backward, nothing more). What lives until the
backward is one gradient per input: (N, D) for the hidden states, (V, D) in FP32 for
the weight.

Numerics follow the plain path: the logits GEMM runs in the compute dtype (autocast's,
or the weight's), log-softmax and the loss in FP32, the two gradient GEMMs in the
compute dtype again. The gradient of the logits is kept unscaled ((softmax - one-hot),
entries in [-1, 1]) and the loss's 1/N and the loss scale are applied in backward: a
float16 copy of (softmax - one-hot) / N would flush its small entries to zero, which is
what loss scaling exists to prevent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP32_LOGITS_BUDGET = 256 * 2**20  # bytes of FP32 logits per chunk


def chunk_tokens(vocab_size: int, budget: int = FP32_LOGITS_BUDGET) -> int:
    """Tokens per chunk: the largest power of two whose FP32 logits fit in `budget`
    (512 for a 128,256-token vocabulary), at least 128."""
    tokens = 128
    while 2 * tokens * vocab_size * 4 <= budget:
        tokens *= 2
    return tokens


GPU_LOGITS_SHARE = 16  # auto, compiled on a GPU: the full logits while their FP32 bytes are <= 1/16 of its memory


def loss_chunk(mode: str, vocab_size: int, tokens: int, gpu_memory: int | None = None,
               compiled: bool = False) -> int:
    """model.loss as tokens per chunk (0: the full logits): chunked when asked; under auto,
    chunked when a micro-batch of `tokens` has more FP32 logits than one chunk holds, except
    compiled on a GPU of `gpu_memory` bytes, where the full logits are kept until they pass
    1/16 of it. The exception is what was measured: a compiled full loss on a GPU keeps no
    FP32 logits (Inductor fuses the upcast into the softmax) and runs one GEMM per gradient;
    on an H200 (1B flavor, 4 x 2048 tokens, 4.2 GB of FP32 logits, compiled) it was both
    faster and lighter than 16 chunks (61,942 against 60,057 tokens/s; 29.3 against 35.2 GiB).
    Eager, the full loss keeps the FP32 logits and their softmax alive: the CPU's rule."""
    chunk = chunk_tokens(vocab_size)
    if mode != "auto":
        return chunk if mode == "chunked" else 0
    fused = gpu_memory is not None and compiled
    limit = gpu_memory // GPU_LOGITS_SHARE // (4 * vocab_size) if fused else chunk
    return chunk if tokens > limit else 0


def _chunk_loss(hc: torch.Tensor, weight: torch.Tensor, tc: torch.Tensor, want_grad: bool):
    """Summed loss of one chunk; with want_grad also d(sum)/d(logits) in the compute dtype."""
    logits = F.linear(hc, weight)  # (C, V), compute dtype
    dtype = logits.dtype
    logp = F.log_softmax(logits.float(), dim=-1)  # FP32, as the plain path's upcast logits
    del logits  # at most C x V x (compute + 4 + 4) bytes alive at once
    loss = F.nll_loss(logp, tc, reduction="sum")
    if not want_grad:
        return loss, None
    g = logp.exp_()  # softmax
    g[torch.arange(tc.numel(), device=tc.device), tc] -= 1.0
    return loss, g.to(dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk):
        # h (N, D), weight (V, D), targets (N,)
        n = targets.numel()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk):
            hc, tc = h[start:start + chunk], targets[start:start + chunk]
            loss, g = _chunk_loss(hc, weight, tc, True)
            total += loss
            if need_h:
                grad_h[start:start + chunk] = g @ weight  # (C, V) @ (V, D); autocast casts the weight
            if need_w:
                grad_w += g.t() @ hc  # (V, C) @ (C, D), summed over chunks in FP32
            del g  # before the next chunk's logits: one chunk's tensors alive at a time
        ctx.n, ctx.weight_dtype = n, weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out.float() / ctx.n  # the mean's 1/N and the loss scale, applied once
        gh = grad_h * scale if grad_h is not None else None  # a 0-dim scale keeps grad_h's dtype
        gw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """mean(cross_entropy(h @ weight.T, targets)) over the N rows of h (N, D), computed
    `chunk` rows at a time; equal to the plain loss up to summation order."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(h, weight, targets, chunk)
    total = sum(_chunk_loss(h[s:s + chunk], weight, targets[s:s + chunk], False)[0]
                for s in range(0, targets.numel(), chunk))
    return total / targets.numel()
