"""The block-wise recipe's backward casts, each reading its operand once and writing every
FP8 copy in the layout its GEMM reads (Transformer Engine's cast-transpose):

    gq, gq_t = cast_transpose(dy)   # dy (M, N): 1 x 128 tiles row-major (the input-gradient GEMM's
                                    # first operand) and 128 x 1 tiles stored as (N, M) row-major
                                    # (the weight-gradient GEMM's first operand, dy^T)
    xq_t = recast_transposed(xq)    # the saved input, dequantised and cast again in 128 x 1 tiles,
                                    # stored as (K, M) row-major (the weight-gradient GEMM's second
                                    # operand, column-major as torch's kernel takes it)

Written with torch's ops these are two reads of dy and a transposing copy of each FP8
result that Inductor does not fuse into one kernel (a reduction along rows and one along
columns). On CUDA, with Triton installed and whole tiles, each is one Triton kernel per
128 x 128 tile, registered as a torch op (torch.library.triton_op) so that a compiled block
keeps it in its graph. The pure-PyTorch casts (mixprec.narrow.formats.scaling.quantize) are the
reference and every other route; tests/narrow/test_blockwise_cast.py runs the kernels on the
CPU in Triton's interpreter against them, bit for bit.

The kernel rounds to e4m3 itself (to nearest, ties to even, on the FP32 bits) and stores the
byte: Triton's interpreter converts FP32 to FP8 wrongly where rounding carries into the
exponent (127.2 became 64), and NaN became -448; the GPU's conversion is not needed.
"""

from __future__ import annotations

import functools
import logging

import torch

from mixprec.narrow.formats.recipe import E4M3
from mixprec.narrow.formats.scaling import EPS, FP8_MAX, Quantized, quantize

logger = logging.getLogger(__name__)

BLOCK = 128


@functools.cache
def _kernel():
    """The kernel (mixprec.narrow.kernels.blockwise_cast), compiled for CUDA at its first launch; run
    in Triton's interpreter on CPU tensors when the process started with TRITON_INTERPRET=1
    (Triton reads it at import: the tests start one such)."""
    from mixprec.narrow.kernels.blockwise_cast import cast_tiles

    return cast_tiles


@functools.cache
def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _launch(kernel, x, xs, rows: bool):
    M, N = x.shape
    q = torch.empty((M, N) if rows else (0,), dtype=torch.uint8, device=x.device)
    qs = torch.empty((M, N // BLOCK) if rows else (0,), dtype=torch.float32, device=x.device)
    qt = torch.empty((N, M), dtype=torch.uint8, device=x.device)
    qts = torch.empty((N, M // BLOCK), dtype=torch.float32, device=x.device)
    kernel[(M // BLOCK, N // BLOCK)](x, xs if xs is not None else x, q, qs, qt, qts, M, N, BLOCK=BLOCK,
                                     DEQUANT=xs is not None, ROWS=rows)
    return q.view(E4M3), qs, qt.view(E4M3), qts


@functools.cache
def register():
    """The kernel as torch ops mixprec::blockwise_cast_transpose and mixprec::blockwise_recast_transposed,
    registered once, outside any trace (by `probe`, on first use: Triton is optional). A compiled step
    reaches them through torch.ops: registering inside a trace is a graph break (Dynamo skips
    torch.library.triton_op), one around every block-wise backward."""
    from torch.library import triton_op, wrap_triton

    @triton_op("mixprec::blockwise_cast_transpose", mutates_args=())
    def cast_transpose_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch(wrap_triton(_kernel()), x, None, True)

    @triton_op("mixprec::blockwise_recast_transposed", mutates_args=())
    def recast_op(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch(wrap_triton(_kernel()), data, scale_inv, False)[2:]

    return cast_transpose_op, recast_op


_PROBED: dict[str, str | None] = {}  # device type -> None where the kernel is used, else why not


def probe(device_type: str) -> str | None:
    """None where the kernel runs on `device_type` and gives the reference casts' bytes and
    scales on a 256 x 384 tensor (both casts); otherwise why the PyTorch casts are used. Run
    once per device and logged then: at conversion, when a converted block-wise layer is moved
    to a device (FP8Linear._apply: a model converted on the CPU or the meta device, then moved
    to CUDA), at Policy.setup (fully_shard moves parameters without _apply), or at an eager
    backward's first cast there. `applies` only reads the answer in a
    compiled step."""
    if device_type not in _PROBED:
        if tracing():  # fake tensors (a memory plan, a trace) run no kernel: asked again for real
            return "not probed while tracing"
        why = _PROBED[device_type] = _probe(device_type)
        if why is None:
            logger.info("fp8: block-wise backward casts on %s in one Triton kernel per operand, both layouts at "
                        "once (mixprec.narrow.formats.blockwise_cast)", device_type)
        elif device_type == "cuda":
            logger.info("fp8: block-wise backward casts with torch's ops, a transposing copy each: %s", why)
    return _PROBED[device_type]


def _probe(device_type: str) -> str | None:
    if device_type != "cuda":
        return f"the Triton kernel runs on CUDA only, not on {device_type}"
    if not has_triton():
        return "Triton is not installed"
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 384, generator=gen) * torch.logspace(-4, 4, 384)).to(device_type)
    try:
        register()
        got = [*cast_transpose(x, triton=True), recast_transposed(quantize(x, E4M3, (1, BLOCK))[0], triton=True)]
    except Exception as e:  # noqa: BLE001 - whatever Triton raises, the PyTorch casts are used and the reason logged
        return f"the Triton kernel failed ({str(e).splitlines()[0][:160] if str(e) else type(e).__name__})"
    want = [*cast_transpose(x, triton=False), recast_transposed(quantize(x, E4M3, (1, BLOCK))[0], triton=False)]
    for g, w in zip(got, want):
        if not (torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8)) and torch.equal(g.scale_inv, w.scale_inv)):
            return "the Triton kernel's casts differ from torch's here"
    return None


def applies(x: torch.Tensor, dtype: torch.dtype, tiles, power_of_2: bool, triton: bool | None = None) -> bool:
    """Whether the kernel computes this cast: e4m3 in (1 x 128, 128 x 1) tiles of a 2-D tensor
    of whole tiles, scales not rounded to powers of two (the reference rounds through log2,
    which the kernel does not repeat), and on x's device the probe passed (triton None) or as
    told."""
    if tuple(tiles) != ((1, BLOCK), (BLOCK, 1)) or dtype != E4M3 or power_of_2 or x.dim() != 2:
        return False
    if x.shape[0] % BLOCK or x.shape[1] % BLOCK:
        return False
    if triton is not None:
        return triton
    if x.device.type not in _PROBED and not tracing(x):
        probe(x.device.type)  # a device no conversion, move or setup probed: probed here, eagerly, once
    return _PROBED.get(x.device.type, "not probed") is None


def tracing(x: torch.Tensor | None = None) -> bool:
    """Whether the code runs traced (Dynamo, or on fake tensors: AOTAutograd's, a memory plan's;
    x's or the active mode's): no kernel runs there."""
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode((x,) if x is not None else ()) is not None


def cast_transpose(x: torch.Tensor, triton: bool | None = None) -> tuple[Quantized, Quantized]:
    """x (M, N) in 1 x 128 tiles, and in 128 x 1 tiles held as the transpose of an (N, M)
    row-major tensor (`.t()` of it is what the weight-gradient GEMM reads, no copy). triton:
    the kernel (True: on any device; a CPU tensor needs Triton's interpreter), the reference (False), or
    where `applies` (None); the caller has checked `applies` for the kernel."""
    if not triton:
        return quantize(x, E4M3, (1, BLOCK))[0], quantize(x, E4M3, (BLOCK, 1))[0]
    x = x.contiguous()
    if x.device.type == "cpu":
        q, qs, qt, qts = _launch(_kernel(), x, None, True)
    else:
        q, qs, qt, qts = torch.ops.mixprec.blockwise_cast_transpose(x)  # registered by probe
    return Quantized(q, qs, (1, BLOCK)), Quantized(qt.t(), qts.t(), (BLOCK, 1))


def recast_transposed(xq: Quantized, triton: bool | None = None) -> Quantized:
    """xq (M, K) in 1 x 128 tiles, dequantised and cast again in 128 x 1 tiles, held as the
    transpose of a (K, M) row-major tensor. triton as cast_transpose's."""
    if not triton:
        return quantize(xq.dequantize(), E4M3, (BLOCK, 1))[0]
    data = xq.data.contiguous()
    if data.device.type == "cpu":
        qt, qts = _launch(_kernel(), data, xq.scale_inv.contiguous(), False)[2:]
    else:
        qt, qts = torch.ops.mixprec.blockwise_recast_transposed(data, xq.scale_inv.contiguous())
    return Quantized(qt.t(), qts.t(), (BLOCK, 1))


assert FP8_MAX[E4M3] == 448.0 and EPS == 1e-12  # the constants written into the kernel
