"""The chunked output layer + loss against the plain one (F.linear, upcast, cross_entropy)."""

import pytest
import torch
import torch.nn.functional as F

from mixprec.models.loss import chunk_tokens, chunked_cross_entropy, loss_chunk

N, D, V = 300, 64, 1000  # 300 tokens in chunks of 128: three chunks, the last one short


def plain(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def loss_and_grads(fn, dtype=None, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen).requires_grad_()
    w = (torch.randn(V, D, generator=gen) * 0.05).requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = fn(h, w, t)
    (loss * scale).backward()  # scale: as a loss scaler would
    return loss.detach(), h.grad, w.grad


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def chunked(h, w, t):
    return chunked_cross_entropy(h, w, t, 128)


def test_fp32_equals_the_plain_loss_up_to_summation_order():
    (l0, h0, w0), (l1, h1, w1) = loss_and_grads(plain), loss_and_grads(chunked)
    assert l1.dtype == torch.float32 and l1.item() == pytest.approx(l0.item(), rel=1e-6)
    assert rel(h1, h0) < 1e-6 and rel(w1, w0) < 1e-6


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
def test_under_autocast_with_a_loss_scale_within_the_formats_rounding(dtype, bound):
    # bf16 keeps 8 significant bits (2^-8 = 3.9e-3), fp16 11 (4.9e-4): the chunked path
    # rounds (softmax - one-hot) where the plain one rounds it times scale / N
    (l0, h0, w0), (l1, h1, w1) = loss_and_grads(plain, dtype, 65536.0), loss_and_grads(chunked, dtype, 65536.0)
    assert l1.item() == pytest.approx(l0.item(), rel=1e-5)
    assert h1.dtype == h0.dtype == torch.float32 and w1.dtype == torch.float32
    assert rel(h1, h0) < bound and rel(w1, w0) < bound


def test_float16_weights_keep_small_gradients_that_an_unscaled_path_would_flush():
    # float16 model (fp16-true / fp16-master): the gradient's entries are ~1/(V N) before
    # the loss scale; the chunked path applies scale / N after its GEMMs, so they survive
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4096, D, generator=gen).half().requires_grad_()
    w = (torch.randn(V, D, generator=gen) * 0.05).half().requires_grad_()
    t = torch.randint(0, V, (4096,), generator=gen)
    ref_h, ref_w = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (plain(ref_h, ref_w, t) * 1024).backward()
    (chunked_cross_entropy(h, w, t, 512) * 1024).backward()
    assert h.grad.dtype == w.grad.dtype == torch.float16
    assert rel(h.grad, ref_h.grad) < 2e-3 and rel(w.grad, ref_w.grad) < 2e-3
    assert (h.grad == 0).float().mean() < 0.01  # nothing flushed to zero


def test_without_grad_it_only_computes_the_loss():
    gen = torch.Generator().manual_seed(0)
    h, w, t = torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen) * 0.05, torch.randint(0, V, (N,))
    with torch.no_grad():
        assert chunked(h, w, t).item() == pytest.approx(plain(h, w, t).item(), rel=1e-6)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch has no linear_cross_entropy")
def test_agrees_with_torchs_own_linear_cross_entropy():
    (l0, h0, w0) = loss_and_grads(lambda h, w, t: F.linear_cross_entropy(h, w, t))
    (l1, h1, w1) = loss_and_grads(chunked)
    assert l1.item() == pytest.approx(l0.item(), rel=1e-6)
    assert rel(h1, h0) < 1e-6 and rel(w1, w0) < 1e-6


def test_chunk_size_bounds_the_fp32_logits():
    assert chunk_tokens(128256) == 512  # Llama 3's vocabulary: 512 x 128256 x 4 B = 250 MiB
    for vocab in (256, 4096, 32768, 128256, 10**6):
        assert chunk_tokens(vocab) >= 128
        assert chunk_tokens(vocab) == 128 or chunk_tokens(vocab) * vocab * 4 <= 256 * 2**20


def test_auto_takes_the_full_logits_compiled_on_a_gpu_while_they_fit_a_sixteenth_of_it():
    # the 1B flavor's 4 x 2048 tokens: 4.2 GB of FP32 logits; compiled, full on an 80 GB or 141 GB GPU,
    # chunked on a 24 GB one; eager (the FP32 logits kept, as measured nowhere faster) chunked as on a CPU
    vocab, tokens = 128256, 4 * 2048
    assert loss_chunk("auto", vocab, tokens, gpu_memory=80 * 10**9, compiled=True) == 0
    assert loss_chunk("auto", vocab, tokens, gpu_memory=141 * 10**9, compiled=True) == 0
    assert loss_chunk("auto", vocab, tokens, gpu_memory=24 * 10**9, compiled=True) == chunk_tokens(vocab)
    assert loss_chunk("auto", vocab, tokens, gpu_memory=141 * 10**9) == chunk_tokens(vocab)
    assert loss_chunk("auto", 2048, 256, gpu_memory=141 * 10**9) == 0
    assert loss_chunk("auto", vocab, tokens) == chunk_tokens(vocab)  # a CPU: 256 MiB
    assert loss_chunk("auto", 2048, 256) == 0
    assert loss_chunk("chunked", vocab, 64, gpu_memory=141 * 10**9) == chunk_tokens(vocab)
    assert loss_chunk("full", vocab, 10**6) == 0
