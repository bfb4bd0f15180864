"""The 8-bit moment formats against their definitions, torch.optim.AdamW and independent peers
(torchao's AdamW8bit / AdamWFp8, bitsandbytes' AdamW8bit: test-only references)."""

import math

import pytest
import torch

from mixprec.errors import UserError
from mixprec.optim import AdamW
from mixprec.optim.state_formats import E4M3, StateFormat, dequantize, dynamic_code, quantize, scale_shape

FORMATS = ("8bit", "fp8")


def nearest_code(n: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The definition by brute force: how many FP32 midpoints of neighbouring code values n reaches."""
    mids = (code[:-1] + code[1:]) / 2
    return (n.unsqueeze(-1) >= mids).sum(-1)


def test_the_dynamic_code_is_its_definition():
    for signed in (True, False):
        code = dynamic_code(signed)
        assert code.shape == (256,) and code.dtype == torch.float32
        assert torch.all(code[1:] > code[:-1])  # sorted, no value twice
        assert code[-1] == 1 and (code == 0).sum() == 1
        assert (code.min() == -code[code < 1].max() if signed else code.min() == 0)
        # each decade below 1 holds 2^e (signed: per sign) or 2^(e+1) values: dense near zero
        for e in range(7):
            inside = ((code.abs() >= 0.1 * 10.0 ** (e - 6)) & (code.abs() < 10.0 ** (e - 6))).sum()
            assert inside == (2 * 2**e if signed else 2 ** (e + 1))


def test_the_code_is_torchaos_and_bitsandbytes():
    ao = pytest.importorskip("torchao.optim.quant_utils")
    for signed in (True, False):
        assert torch.equal(dynamic_code(signed), torch.tensor(ao.create_dynamic_map(signed)))
    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        return
    for signed in (True, False):
        assert torch.equal(dynamic_code(signed), bnb.create_dynamic_map(signed=signed))


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_codes_are_the_nearest_code_values_of_each_block(signed):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 700, generator=gen) * torch.logspace(-6, 2, 6).reshape(6, 1)  # 3 blocks a row, the last short
    x = x if signed else x.square()
    code = dynamic_code(signed)
    # exact ties: halfway between two code values, in a block whose absmax is 1
    x[0, :256] = x[0, :256] / x[0, :256].abs().max()
    ties = (code[100:140] + code[101:141]) / 2
    x[0, 1:41] = ties if signed else ties.abs()
    codes, scales = quantize(x, "8bit", 256, signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scales.shape == (6, 3)
    absmax = torch.stack([x[:, i:i + 256].abs().amax(1) for i in (0, 256, 512)], 1)
    assert torch.equal(scales, absmax)
    n = x / absmax.repeat_interleave(256, 1)[:, :700]
    assert torch.equal(codes.long(), nearest_code(n, code))
    # that is the nearest code value (to the midpoints' rounding), a tie going to the larger
    apart = (code[codes.long()] - n).abs()
    assert torch.all(apart <= (code.reshape(1, 1, -1) - n.unsqueeze(-1)).abs().amin(-1) + 2**-23 * n.abs() + 1e-30)
    assert torch.equal(codes[0, 1:41].long(), torch.arange(101, 141) if signed else codes[0, 1:41].long())
    assert torch.equal(dequantize(codes, scales, 256, signed), code[codes.long()] * absmax.repeat_interleave(256, 1)[:, :700])


def test_fp8_codes_are_e4m3_of_each_block_over_its_scale():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 300, generator=gen) * 3
    codes, scales = quantize(x, "fp8", 128)
    assert codes.dtype == E4M3 and scales.shape == scale_shape(x.shape, 128) == (5, 3)
    s = torch.stack([x[:, i:i + 128].abs().amax(1) for i in (0, 128, 256)], 1) / 448
    assert torch.equal(scales, s)
    wide = s.repeat_interleave(128, 1)[:, :300]
    assert torch.equal(codes.view(torch.uint8), (x / wide).to(E4M3).view(torch.uint8))  # torch's round to nearest even
    assert torch.equal(dequantize(codes, scales, 128), codes.float() * wide)
    assert codes.float().abs().amax() == 448  # each block's largest element is the largest code


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_subnormals_and_non_finite_blocks(fmt):
    x = torch.randn(4, 512)
    x[0, :256] = 0  # a zero block stays zero
    x[1, :256] = torch.randn(256) * 1e-41  # subnormal FP32 values
    x[2, 256:] = torch.randn(256) * 1e-38
    x[3, 7] = math.inf  # a non-finite element: its block is NaN after the round trip, the rest is not
    codes, scales = quantize(x, fmt, 256)
    back = dequantize(codes, scales, 256)
    assert scales[0, 0] == 0 and torch.equal(back[0, :256], torch.zeros(256))
    assert torch.isnan(back[3, :256]).all() and torch.isfinite(back[3, 256:]).all()
    assert torch.isfinite(back[:3]).all()
    for row, cols in ((1, slice(0, 256)), (2, slice(256, 512))):
        rel = (back[row, cols] - x[row, cols]).double().norm() / x[row, cols].double().norm()
        assert rel < (0.02 if fmt == "8bit" else 0.05), rel  # the scale keeps tiny blocks resolved
    rel = (back[:3, 256:] - x[:3, 256:]).norm() / x[:3, 256:].norm()
    assert rel < 0.05


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_never_span_rows_so_a_shard_of_rows_quantizes_alike(fmt):
    """What makes the state independent of the number of ranks: FSDP2 shards dimension 0."""
    x = torch.randn(7, 333)
    codes, scales = quantize(x, fmt, 256)
    for rows in (slice(0, 4), slice(4, 7)):
        c, s = quantize(x[rows], fmt, 256)
        assert torch.equal(c.view(torch.uint8), codes[rows].view(torch.uint8)) and torch.equal(s, scales[rows])


def test_same_bytes_as_torchao_and_the_differences_from_bitsandbytes():
    """torchao's block quantization of the same FP32 values is ours byte for byte (its blocks are
    flat: equal to ours where the last dimension is a multiple of the block). bitsandbytes' CPU
    kernel (0.50.2) keeps the same scales but picks a farther code for some elements: measured 42
    of 32768 first-moment and 1036 of 32768 second-moment elements (random normal values and their
    squares), one code step apart, or up to 7 steps where the value is under 1e-4 of its block's
    maximum (the code's densest part); ours is never the farther one."""
    ao = pytest.importorskip("torchao.optim.quant_utils")
    from torchao.optim.subclass_fp8 import quantize_fp8

    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * torch.rand(64, 1)
    for signed, values in ((True, x), (False, x.square())):
        codes, scales = quantize(values, "8bit", 256, signed)
        normalized, ao_scales = ao.scale_tensor(values, 256)
        ao_codes = ao.quantize_8bit_with_qmap(normalized, torch.tensor(ao.create_dynamic_map(signed)))
        assert torch.equal(codes, ao_codes.view(codes.shape)) and torch.equal(scales.flatten(), ao_scales)
    codes, scales = quantize(x, "fp8", 256)
    ao_codes, ao_scales = quantize_fp8(x, 256)
    assert torch.equal(codes.view(torch.uint8), ao_codes.view(torch.uint8).view(codes.shape))
    assert torch.equal(scales.flatten(), ao_scales)
    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        return
    for signed, values in ((True, x), (False, x.square())):
        codes, scales = quantize(values, "8bit", 256, signed)
        bnb_codes, bnb_state = bnb.quantize_blockwise(values, code=dynamic_code(signed), blocksize=256)
        assert torch.equal(scales.flatten(), bnb_state.absmax)
        n, code = values / scales.repeat_interleave(256, 1), dynamic_code(signed)
        ours, theirs = (code[codes.long()] - n).abs(), (code[bnb_codes.long()] - n).abs()
        assert torch.all(ours <= theirs) and (theirs > ours).any()  # where they differ, bitsandbytes' is farther


def adamw_pair(fmt, steps=3, shape=(64, 512), compile=False):
    torch.manual_seed(0)
    p = torch.randn(shape, requires_grad=True)
    opt = AdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, states=fmt, compile=compile)
    for _ in range(steps):
        p.grad = torch.randn_like(p)
        opt.step()
    return p, opt


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_step_equals_torchs_adamw_on_the_dequantized_moments(fmt):
    p, opt = adamw_pair(fmt)
    state = opt.state[p]
    moments = {k: dequantize(state[k], state[k + "_absmax"], 256, signed) for k, signed in
               (("exp_avg", True), ("exp_avg_sq", False))}
    ref = p.detach().clone().requires_grad_()
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    torch_opt.state[ref] = {"step": torch.tensor(3.0), **{k: v.clone() for k, v in moments.items()}}
    p.grad = torch.randn_like(p)
    ref.grad = p.grad.clone()
    opt.step()
    torch_opt.step()
    assert torch.equal(p, ref)
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        codes, scales = quantize(torch_opt.state[ref][key], fmt, 256, signed)  # re-quantized once
        assert torch.equal(codes.view(torch.uint8), state[key].view(torch.uint8))
        assert torch.equal(scales, state[key + "_absmax"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(64, 512), (33, 300)])  # whole blocks, and rows that end in a short block
def test_the_compiled_kernel_is_the_eager_reference_but_for_the_arithmetics_last_bits(fmt, shape):
    """One compiled kernel a parameter (the trainer's path; Inductor's C++ here, Triton on a GPU)
    against the eager path that equals torch.optim.AdamW: its multiply-adds and the order of the
    moment update move the last bits, so a moment lying on a rounding boundary may take the next
    code. Measured (AVX512 CPU) after 5 steps: weights within 1e-6, codes equal but for a few."""
    eager, eager_opt = adamw_pair(fmt, steps=5, shape=shape)
    compiled, compiled_opt = adamw_pair(fmt, steps=5, shape=shape, compile=True)
    assert (eager - compiled).abs().max() < 1e-5
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = (o.state[p][key].view(torch.uint8) for o, p in ((eager_opt, eager), (compiled_opt, compiled)))
        assert (a != b).float().mean() < 1e-3, key


def regression(make, steps=200, seed=0):
    """AdamW on a least-squares problem with fresh minibatches: the final weights."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(128, 512, generator=g)
    w = torch.zeros(128, 512, requires_grad=True)
    opt = make([w])
    for _ in range(steps):
        x = torch.randn(32, 512, generator=g)
        loss = ((x @ (w - target).T) ** 2).mean()
        w.grad, = torch.autograd.grad(loss, w)
        opt.step()
    return w.detach()


@pytest.mark.slow
def test_200_steps_track_fp32_adamw_as_torchao_and_bitsandbytes_do():
    """Measured (AVX512 CPU, torch 2.13, 256 x 512, lr 1e-2): distance from FP32 AdamW relative
    to its weights, 8bit 7.58e-3 (torchao AdamW8bit 7.58e-3, bitsandbytes 7.59e-3), fp8
    2.02e-2 (torchao AdamWFp8 2.02e-2); ours against theirs 1.1e-3 (torchao 8-bit), 4.5e-3
    (bitsandbytes), 1.7e-3 (torchao FP8): the same algorithm, their arithmetic in another order."""
    ao = pytest.importorskip("torchao.optim")
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    ref = regression(lambda p: torch.optim.AdamW(p, foreach=False, **kw))
    dist = lambda a, b: float((a - b).norm() / ref.norm())
    ours = {fmt: regression(lambda p: AdamW(p, states=fmt, **kw)) for fmt in FORMATS}
    peers = {"8bit": regression(lambda p: ao.AdamW8bit(p, **kw)), "fp8": regression(lambda p: ao.AdamWFp8(p, **kw))}
    for fmt in FORMATS:
        assert dist(ours[fmt], ref) < 1.2 * dist(peers[fmt], ref) + 1e-4
        assert dist(ours[fmt], peers[fmt]) < 0.3 * dist(ours[fmt], ref)
    assert dist(ours["8bit"], ref) < 0.02 and dist(ours["fp8"], ref) < 0.05
    try:
        import bitsandbytes as bnb
    except ImportError:
        return
    theirs = regression(lambda p: bnb.optim.AdamW8bit(p, **kw))
    assert dist(ours["8bit"], theirs) < 0.8 * dist(ours["8bit"], ref)


def test_small_tensors_and_embeddings_keep_fp32_moments_with_a_reason():
    emb = torch.nn.Embedding(100, 64)
    big, small = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(64))
    opt = AdamW([emb.weight, big, small], states="8bit", embeddings=[emb.weight])
    assert opt.kept_fp32 == {id(emb.weight): "an embedding", id(small): "fewer than 4096 elements"}
    for p in (emb.weight, big, small):
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[big]["exp_avg"].dtype == torch.uint8 and opt.state[big]["moments_block"] == 256
    assert opt.state[emb.weight]["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in opt.state[small]
    everything = AdamW([emb.weight, big], states=StateFormat("fp8", block_size=64, min_size=0, embeddings=True),
                       embeddings=[emb.weight])
    assert everything.kept_fp32 == {}


def test_state_dict_keeps_fp32_scales_of_a_bfloat16_model_and_refuses_another_format():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 512, dtype=torch.bfloat16))
    opt = AdamW([p], lr=1e-3, states="8bit", compensated=True)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    saved = opt.state_dict()
    again = AdamW([p], lr=1e-3, states="8bit", compensated=True)
    again.load_state_dict(saved)
    for key, value in opt.state[p].items():
        if torch.is_tensor(value):
            assert again.state[p][key].dtype == value.dtype and torch.equal(again.state[p][key], value), key
    assert again.state[p]["exp_avg_absmax"].dtype == torch.float32  # torch's load would have made it bfloat16
    with pytest.raises(UserError, match="saved with 8bit .blocks of 256. moments, this run keeps fp8"):
        AdamW([p], states="fp8").load_state_dict(saved)
    with pytest.raises(UserError, match="convert_optimizer_states"):
        AdamW([p], states="8bit", moments_dtype=torch.bfloat16).load_state_dict(
            AdamW([p], states="bf16").state_dict() | {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(
                64, 512, dtype=torch.bfloat16), "exp_avg_sq": torch.zeros(64, 512, dtype=torch.bfloat16)}}})
    converted = AdamW([p], lr=1e-3, states="fp8", convert=True)
    converted.load_state_dict(saved)
    m8 = dequantize(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_absmax"], 256)
    m = dequantize(converted.state[p]["exp_avg"], converted.state[p]["exp_avg_absmax"], 256)
    assert converted.state[p]["exp_avg"].dtype == E4M3 and (m - m8).norm() / m8.norm() < 0.05


def test_compensated_bfloat16_weights_track_fp32_weights():
    """bf16-kahan-8bit's update: bfloat16 weights plus a bfloat16 compensation follow FP32 weights
    with the same 8-bit moments far closer than bfloat16 weights rounded to nearest."""
    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)

    start = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    grads = [torch.randn(64, 256, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(50)]

    def run(dtype, compensated):  # the same bfloat16 values in, only the weights' storage differs
        w = torch.nn.Parameter(start.to(dtype))
        opt = AdamW([w], states="8bit", compensated=compensated, **kw)
        for g in grads:
            w.grad = g.to(dtype)
            opt.step()
        c = opt.state[w].get("kahan_compensation")
        return w.detach().float() + (c.float() if c is not None else 0)

    ref = run(torch.float32, False)
    kahan, nearest = run(torch.bfloat16, True), run(torch.bfloat16, False)
    moved = (ref - start.float()).norm()
    assert (nearest - start.float()).norm() < 0.5 * moved  # updates under half a bfloat16 step round away
    assert (kahan - ref).norm() < 0.01 * moved


def test_a_skipped_step_changes_nothing():
    p, opt = adamw_pair("8bit")
    before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    w = p.detach().clone()
    p.grad = torch.randn_like(p)
    opt.found_inf, opt.grad_scale = torch.ones(()), None
    opt.step()
    del opt.found_inf, opt.grad_scale
    assert torch.equal(p, w)
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())


def test_bad_format_keys_are_one_line():
    with pytest.raises(UserError, match="unknown format 'int4'; accepted: fp32, bf16, fp16, fp8, 8bit"):
        StateFormat("int4")
    with pytest.raises(UserError, match="optimizer_state_block"):
        StateFormat("8bit", block_size=0)


@pytest.mark.parametrize("fmt", ["8bit", "fp8"])
@pytest.mark.parametrize("shape", [(0, 300), (0, 4, 256), (0, 256)])
def test_an_empty_shard_quantizes_to_empty_codes_and_scales(fmt, shape):
    """A rank of FSDP2 that holds no row of a tensor: empty codes and scales, and back (it crashed: a view of
    zero rows cannot infer its blocks)."""
    x = torch.empty(shape)
    codes, scales = quantize(x, fmt, 256)
    assert codes.shape == x.shape and scales.shape == (*shape[:-1], -(-shape[-1] // 256))
    assert dequantize(codes, scales, 256).shape == x.shape


def test_one_dimensional_tensors_keep_fp32_moments_in_one_process_as_under_fsdp2():
    from mixprec.optim import AdamW
    from mixprec.optim.state_formats import StateFormat

    assert "1-D" in StateFormat("8bit").keeps_fp32(8192, False, 1)
    assert StateFormat("8bit").keeps_fp32(8192, False, 2) is None
    bias, weight = torch.zeros(8192, requires_grad=True), torch.zeros(32, 256, requires_grad=True)
    opt = AdamW([bias, weight], states="8bit", compile=False)
    for p in (bias, weight):
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[bias]["exp_avg"].dtype == torch.float32 and opt.state[weight]["exp_avg"].dtype == torch.uint8
