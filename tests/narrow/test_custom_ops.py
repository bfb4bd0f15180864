"""Every operator mixprec registers (torch.library) checked by torch.library.opcheck: its
schema, its fake (meta) function against the real one (sizes, strides, dtypes), its autograd
registration and its AOT dispatch, on shapes off the 16/32/128 grid. A fake function that
disagrees with the real one crashes a compiled step ("an incorrect fake kernel"), only at the
shapes where they differ. The block-wise GEMM has no CPU kernel: its fake is checked against
torch's own meta function of the GEMM it calls. The Triton casts are torch.library.triton_op:
their fake function is their own Python with the kernel launch left out, the same
allocations by construction (Triton's interpreter would launch the kernel on the fake
tensors); they are opchecked on CUDA (tests/narrow/test_blockwise_cast.py, gpu)."""

import pytest
import torch
import torch.nn.functional as F

from mixprec.narrow.experts import ops as experts  # noqa: F401 - registers the operators
from mixprec.narrow.formats import mx  # noqa: F401
from mixprec.narrow.gemm import fp8 as gemm  # noqa: F401
from mixprec.narrow.formats.microscaling import E2M1, E4M3, E5M2

CHECKED_ELSEWHERE = {"mixprec::blockwise_cast_transpose", "mixprec::blockwise_recast_transposed",  # on CUDA
                     "mixprec::experts_mm", "mixprec::experts_mm_backward",  # tests/narrow/test_experts.py
                     "mixprec::experts_mm_cast_input", "mixprec::experts_mm_cast_input_backward",
                     # Triton kernels, in Triton's interpreter: tests/narrow/experts_blockwise_cases.py
                     "mixprec::grouped_blockwise_mm", "mixprec::grouped_blockwise_wgrad"}


def registered() -> set[str]:
    return {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("mixprec::")}


def values(R, C, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(R, C, generator=gen) * torch.logspace(-3, 3, C)
    x[::5, ::7] = 0.0
    return x


def quantize_cases():
    key = torch.tensor(7, dtype=torch.int32)
    # (x, element, block, rounding, nv, square, four_over_six, key, amax, values)
    return {
        "mxfp8-40-tokens": (values(40, 64), E4M3, 32, "ceil", False, False, False, None, None, True),
        "mxfp8-bfloat16-40-tokens": (values(40, 64).bfloat16(), E4M3, 32, "ceil", False, False, False, None, None,
                                     True),
        "mxfp8-e5m2-floor-100x48": (values(100, 48), E5M2, 32, "floor", False, False, False, None, None, True),
        "mxfp4-even-stochastic-25x96": (values(25, 96), E2M1, 32, "even", False, False, False, key, None, True),
        "nvfp4-2d-4over6-40x48": (values(40, 48), E2M1, 16, "ceil", True, True, True, None, None, True),
        "nvfp4-shard-amax-no-values": (values(24, 32), E2M1, 16, "ceil", True, False, False, key,
                                       torch.tensor(900.0), False),
    }


def mm_args(R: int, N: int, K: int, name: str):
    recipe = mx.MXRecipe.from_name(name)
    a, b = recipe.quantize(values(R, K, 1), values=True), recipe.quantize(values(N, K, 2))
    return (a.data, a.scale, a.tensor_scale, list(a.block), list(a.shape), b.data, b.scale, b.tensor_scale,
            list(b.block), list(b.shape), torch.bfloat16, a.values, None)


def cases():
    out = [pytest.param("mixprec::mx_quantize", args, id=f"mx_quantize-{name}")
           for name, args in quantize_cases().items()]
    q = mx.MXRecipe.from_name("nvfp4").quantize(values(48, 80), square=True)
    out.append(pytest.param("mixprec::mx_transpose", (q.data, q.scale), id="mx_transpose-nvfp4-48x80"))
    q1 = mx.MXRecipe.from_name("nvfp4").quantize(values(16, 64), square=True)  # one row of blocks: no alias returned
    out.append(pytest.param("mixprec::mx_transpose", (q1.data, q1.scale), id="mx_transpose-nvfp4-16x64"))
    q8 = mx.MXRecipe.from_name("mxfp8").quantize(values(40, 64))
    out.append(pytest.param("mixprec::mx_transpose", (q8.data, q8.scale), id="mx_transpose-fp8-40x64"))
    out += [pytest.param("mixprec::mx_mm", mm_args(R, N, K, name), id=f"mx_mm-{name}-{R}x{N}x{K}")
            for name, (R, N, K) in (("mxfp8", (40, 64, 96)), ("nvfp4", (25, 48, 32)), ("mxfp4", (100, 32, 64)))]
    # the base mode's experts outside bfloat16: 4 experts of 7, 0, 20 and 3 rows, 2 rows past the last group
    offs = torch.tensor([7, 7, 27, 30], dtype=torch.int32)
    x, w = values(32, 24).requires_grad_(), values(4 * 24, 40, 3).view(4, 24, 40).requires_grad_()
    out.append(pytest.param("mixprec::experts_mm_loop", (x, w, offs), id="experts_mm_loop-float32"))
    out.append(pytest.param("mixprec::experts_mm_loop_backward", (x.detach(), w.detach(), offs, values(32, 40, 4)),
                            id="experts_mm_loop_backward-float32"))
    # the grouped experts' GEMMs: 2-D x 3-D by groups of rows, 2-D x 2-D by groups of the summed dimension,
    # the FP8 elements riding along (K and N off the 16-byte stride rule: copied to aligned storage inside)
    xs, ws, gs = values(32, 24), values(4 * 24, 37, 5).view(4, 24, 37), values(32, 37, 6)
    elements = xs.to(torch.float8_e4m3fn), ws.to(torch.float8_e4m3fn)
    out.append(pytest.param("mixprec::grouped_mm", (xs, ws, offs, *elements), id="grouped_mm-2dx3d"))
    out.append(pytest.param("mixprec::grouped_mm", (gs.t(), xs, offs, *elements), id="grouped_mm-2dx2d"))
    return out


def test_every_registered_operator_has_a_check():
    checked = {p.values[0] for p in cases()} | {"mixprec::blockwise_scaled_mm"} | CHECKED_ELSEWHERE
    assert registered() - checked == set()
    assert {"mixprec::mx_quantize", "mixprec::mx_transpose", "mixprec::mx_mm",
            "mixprec::blockwise_scaled_mm"} <= registered()


@pytest.mark.parametrize("op, args", cases())
def test_opcheck(op, args):
    namespace, name = op.split("::")
    fn = getattr(getattr(torch.ops, namespace), name).default
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    narrow = [a for a in args if isinstance(a, torch.Tensor) and a.element_size() == 1 and a.is_floating_point()]
    if narrow:
        # opcheck's schema test copies and compares the inputs with ops torch lacks for FP8 and
        # FP4 tensors: what it checks (no input mutated, as mutates_args=() says) is checked here
        # on the bytes
        utils = utils[1:]
        before = [a.view(torch.uint8).clone() for a in narrow]
        fn(*args)
        assert all(torch.equal(b, a.view(torch.uint8)) for b, a in zip(before, narrow))
    torch.library.opcheck(fn, args, test_utils=utils)


@pytest.mark.parametrize("M, K, N, b_blocks", [(40, 256, 384, True), (200, 128, 256, False), (256, 384, 128, True)])
def test_the_blockwise_gemms_fake_is_torchs_meta_function(M, K, N, b_blocks):
    # CUDA's operands, on the meta device: a (M, K) row-major, b (K, N) column-major, scales
    # laid out as gemm.kernel_scales lays them (torch's meta function checks them)
    from mixprec.narrow.formats.scaling import quantize

    a = quantize(torch.randn(M, K), E4M3, (1, 128))[0]
    b = quantize(torch.randn(K, N), E4M3, (128, 128) if b_blocks else (128, 1))[0]
    scale_a, scale_b, _ = gemm.kernel_scales(a, b, blockwise=True)
    A, B = a.data.contiguous().to("meta"), b.data.t().contiguous().t().to("meta")
    scale_a, scale_b = scale_a.to("meta"), scale_b.to("meta")
    kind_b = F.ScalingType.BlockWise128x128 if b_blocks else F.ScalingType.BlockWise1x128
    want = F.scaled_mm(A, B, scale_a, F.ScalingType.BlockWise1x128, scale_b, kind_b, output_dtype=torch.bfloat16)
    got = gemm.blockwise_scaled_mm(A, B, scale_a, scale_b, b_blocks, torch.bfloat16)
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
