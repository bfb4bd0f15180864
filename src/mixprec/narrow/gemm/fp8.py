"""Scaled FP8 GEMMs: torch's own kernels where the device has one for the layout, and an
emulation with the same numerics where it has none.

    out = scaled_mm(a, b, out_dtype)        # a (M, K), b (K, N), both Quantized

The emulation is DeepSeek-V3's accumulation scheme: FP8 x FP8 products are exact in FP32;
they are summed in FP32 over one tile of K (128 for block-wise, all of K for tensor- and
row-wise), and each partial sum is multiplied by its two scales and added into an FP32
accumulator. For tensor- and row-wise scales that is the same as dequantising first and
running an FP32 GEMM; tests/narrow/test_gemm.py checks both, and the kernels against it.

Which route each GEMM takes is decided once per (device, layout) by `route_on`: the kernel is
run on a 512 x 512 x 512 problem and compared with the emulation (`probe`); a kernel that is
missing, refuses the layout or disagrees is not used, and the caller logs why. On a CPU the
kernel must also be measured faster than the emulation (`cpu_speed`): where torch's CPU FP8
GEMM is oneDNN's reference code (CPUs with AMX, torch 2.13) a tensor-wise e4m3 GEMM of
64 x 512 x 512 took 2,028 ms against the emulation's 16 ms.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from mixprec.narrow.formats.recipe import GEMMS
from mixprec.narrow.formats.scaling import EPS, Quantized, per_tile, quantize

logger = logging.getLogger(__name__)
CPU_MARGIN = 1.5  # on a CPU the kernel runs only where it is this many times faster than the emulation


def emulated_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    (M, K), N = a.data.shape, b.data.shape[1]
    kb = min(a.tile[1], b.tile[0])  # K elements per partial sum
    a32, b32 = a.data.float(), b.data.float()

    def scaled(partial, ka, kb_):  # times a's scales of K tile ka (per row tile), b's of K tile kb_ (per column tile)
        partial = per_tile(torch.mul, partial, a.scale_inv[:, ka:ka + 1], (a.tile[0], N))
        return per_tile(torch.mul, partial, b.scale_inv[kb_:kb_ + 1], (M, b.tile[1]))

    if kb >= K:
        return scaled(a32 @ b32, 0, 0).to(out_dtype)
    out = torch.zeros(M, N, device=a.data.device)
    for k in range(0, K, kb):  # one partial sum per K tile, promoted into the FP32 accumulator
        out += scaled(a32[:, k:k + kb] @ b32[k:k + kb], k // a.tile[1], k // b.tile[0])
    return out.to(out_dtype)


def layout(q: Quantized, side: str) -> str:
    """tensorwise (one scale), rowwise (one per row of a, per column of b) or blockwise."""
    rows, cols = q.data.shape
    if q.scale_inv.numel() == 1:
        return "tensorwise"
    if (side == "a" and q.tile == (1, cols)) or (side == "b" and q.tile == (rows, 1)):
        return "rowwise"
    return "blockwise"


def _column_major(s: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """s (R, C) as a column-major (stride (1, R')) tensor of R' = rows (>= R, padded with ones) rows."""
    R, C = s.shape
    padded = torch.ones(C, rows or R, device=s.device)
    padded[:, :R] = s.t()
    return padded.t()


def kernel_scales(a: Quantized, b: Quantized, blockwise: bool | None = None):
    """(scale_a, scale_b, scaling types): a's and b's scales as torch's scaled GEMMs check them
    (torch's meta functions state the rules; tests/narrow/test_gemm.py runs them on the CPU).
    Scaling types None: torch._scaled_mm, a 0-dim scale each (tensor-wise) or (M, 1) and (1, N)
    (row-wise). Block-wise: F.scaled_mm with ScalingType values; 1x128 tiles of a as (M, K/128)
    and of b (128 along K) as (N, K/128), both column-major; 128x128 blocks of b as
    (L4, N/128) column-major, L4 = K/128 rounded up to a multiple of 4 (the rows past K/128
    padded). blockwise: whether the recipe is block-wise; None: from the layouts. It must be
    said where a weight is one block, or one row of blocks: its scales alone read as
    tensor- or row-wise, a pair torch has no kernel for."""
    kind_a, kind_b = layout(a, "a"), layout(b, "b")
    if blockwise is None:
        blockwise = "blockwise" in (kind_a, kind_b) or kind_a != kind_b
    sa, sb = a.scale_inv.float(), b.scale_inv.float()
    if not blockwise:
        single = (kind_a == "tensorwise" and a.data.shape[0] == 1) or (kind_b == "tensorwise" and b.data.shape[1] == 1)
        if {kind_a, kind_b} == {"tensorwise", "rowwise"} and single:  # one token (an expert's only one): its one
            kind_a = kind_b = "rowwise"  # scale is its row's
        if kind_a != kind_b:
            raise ValueError(f"no scaled GEMM takes a {kind_a} a with a {kind_b} b")
        if kind_a == "tensorwise":
            return sa.reshape(()), sb.reshape(()), None
        # (M, 1) and (1, N) with unit strides (a size-1 dim's stride survives .contiguous())
        return sa.reshape(-1).contiguous().view(-1, 1), sb.reshape(-1).contiguous().view(1, -1), None
    if a.tile[0] != 1:
        raise ValueError(f"a's {a.tile} tiles: torch's block-wise GEMMs here take a in 1x128 tiles")
    k_tiles = sa.shape[1]
    types = (F.ScalingType.BlockWise1x128,
             F.ScalingType.BlockWise1x128 if b.tile[1] == 1 else F.ScalingType.BlockWise128x128)
    if b.tile[1] == 1:  # 128 along K, one column each: as b's transpose holds them
        return _column_major(sa), _column_major(sb.t()), types
    return _column_major(sa), _column_major(sb, -(-k_tiles // 4) * 4), types


# The kernel each route of kernel_mm runs, as the conversion's log line names it.
KERNELS = {"tensorwise": "torch._scaled_mm", "rowwise": "torch._scaled_mm row-wise",
           "rowwise-after": "torch._scaled_mm row-wise, or with unit scales and the row scales applied to its FP32 "
                            "output, whichever was measured faster for the layer's shape (gemm.choose_rowwise)",
           "blockwise": "torch.nn.functional.scaled_mm block-wise (mixprec::blockwise_scaled_mm)"}


def scales_after(device_type: str, fast_accum: bool) -> bool:
    """Whether a row-wise GEMM may run as a tensor-wise one with unit scales, the row scales
    multiplied into its FP32 output after (torchao's route): on CUDA without fast
    accumulation, where torch's row-wise kernel (CUTLASS) is slower than the tensor-wise
    one (cuBLAS) for some shapes (`rowwise_after` says for which, as measured). The same sums,
    the same two scale products: with power-of-two scales (the row-wise recipe's) both are
    exact; tests/narrow/test_gemm.py checks the results equal."""
    return device_type == "cuda" and not fast_accum


ROWWISE_TOKENS = 8192  # the tokens a row-wise route is timed at: a micro-batch of 4 x 2048
_AFTER: dict[tuple, bool] = {}  # (device type, GEMM, N, K of the weight) -> scales after, as measured


def rowwise_after(device_type: str, gemm: str, weight_shape: tuple[int, int], fast_accum: bool) -> bool:
    """Whether a row-wise `gemm` (one of recipe.GEMMS) of a Linear with this (N, K) weight runs as a
    unit-scaled GEMM with the row scales after: on CUDA without fast accumulation, unless
    `choose_rowwise` measured torch's row-wise kernel faster for that GEMM of that shape."""
    if not scales_after(device_type, fast_accum):
        return False
    return _AFTER.get((device_type, gemm, *weight_shape), True)


def _route_seconds(device: str, m: int, k: int, n: int, dtypes) -> tuple[float, float]:
    """Seconds of an (m, k) x (k, n) row-wise GEMM on torch's row-wise kernel and with the scales after."""
    a_dtype, b_dtype, out_dtype = dtypes
    gen = torch.Generator().manual_seed(0)
    a, _ = quantize(torch.randn(m, k, generator=gen).to(device), a_dtype, (1, 0), power_of_2=True)
    b, _ = quantize(torch.randn(k, n, generator=gen).to(device), b_dtype, (0, 1), power_of_2=True)

    def seconds(after: bool) -> float:
        for _ in range(3):  # warm-up: cuBLAS's and CUTLASS's first calls choose their kernels
            kernel_mm(a, b, out_dtype, after=after)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            kernel_mm(a, b, out_dtype, after=after)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 10 / 1e3

    return seconds(False), seconds(True)


def choose_rowwise(device: str, recipe, compute_dtype: torch.dtype, weight_shape: tuple[int, int],
                   tokens: int = ROWWISE_TOKENS) -> None:
    """For a row-wise Linear of this (N, K) weight on CUDA: each GEMM timed both ways at `tokens` tokens
    (torch's row-wise kernel, CUTLASS's, against the tensor-wise one with the row scales multiplied
    into its FP32 output after), the faster kept for the layers of this shape and said with both
    figures. Once per shape and device; outside any trace."""
    if not scales_after(device, recipe.fast_accum):
        return
    N, K = weight_shape
    shapes = dict(zip(GEMMS, ((tokens, K, N), (tokens, N, K), (N, tokens, K))))  # (M, K, N) each
    for gemm, _, dtypes in recipe.gemms(compute_dtype):
        key = (device, gemm, N, K)
        if key in _AFTER:
            continue
        kernel, after = _route_seconds(device, *shapes[gemm], dtypes)
        _AFTER[key] = after <= kernel
        logger.info("fp8: row-wise %s GEMM of a %d x %d weight (%s): torch's row-wise kernel %.3f ms, unit scales "
                    "and the row scales after %.3f ms at %d tokens: %s", gemm, N, K, " x ".join(map(str, shapes[gemm])),
                    kernel * 1e3, after * 1e3, tokens, "scales after" if _AFTER[key] else "torch's row-wise kernel")


def route(layout_: str, device_type: str, fast_accum: bool) -> str:
    """The key of KERNELS a GEMM of operands laid out as `layout_` runs on."""
    if layout_ == "rowwise" and scales_after(device_type, fast_accum):
        return "rowwise-after"
    return layout_


@torch.library.custom_op("mixprec::blockwise_scaled_mm", mutates_args=())
def blockwise_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        b_blocks: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """torch's block-wise scaled GEMM (1x128 tiles of a; b in 128x128 blocks, or in 1x128
    tiles along K), as one op: torch.compile keeps it in the block's graph, whatever torch
    version's functional wrapper it calls (a call that Dynamo cannot trace would split the
    graph around the FP8 matmul, and leave the casts beside it unfused)."""
    kind_b = F.ScalingType.BlockWise128x128 if b_blocks else F.ScalingType.BlockWise1x128
    return F.scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b, kind_b, output_dtype=out_dtype)


@blockwise_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, b_blocks, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _pad_k(A: torch.Tensor, B: torch.Tensor, multiple: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A (M, K) row-major and B (K, N) column-major with K padded with zeros to a multiple of
    `multiple` (torch._scaled_mm's rule on CUDA): zero products add nothing, and tensor- and
    row-wise scales do not run along K, so the result is the same sum. Where a GEMM sums over the tokens
    (the weight gradient), any micro-batch of an odd length needs it."""
    pad = -A.shape[1] % multiple
    if not pad:
        return A, B
    widen = lambda t: F.pad(t.view(torch.uint8), (0, pad)).view(t.dtype)  # noqa: E731 - a zero byte is +0 in e4m3 and e5m2
    return widen(A), widen(B.t()).t()


def kernel_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False,
              blockwise: bool | None = None, after: bool | None = None) -> torch.Tensor:
    """torch's scaled GEMM: a row-major, b column-major (a transposed row-major tensor).
    after: row-wise scales applied after a unit-scaled GEMM (None: where `scales_after`
    chooses it for a's device)."""
    A, B = a.data.contiguous(), b.data.t().contiguous().t()
    scale_a, scale_b, types = kernel_scales(a, b, blockwise)
    if types is not None:
        # b in 128x128 blocks where its tiles span rows: types[1] says the same, but torch 2.11's
        # Dynamo cannot compare ScalingType members (a graph break around every block-wise GEMM)
        return blockwise_scaled_mm(A, B, scale_a, scale_b, b.tile[1] != 1, out_dtype)
    if A.device.type != "cpu":  # the CPU's kernel takes any K: padded there, its sums would reorder (last bits)
        A, B = _pad_k(A, B)
    if scale_a.dim() == 2 and (scales_after(A.device.type, fast_accum) if after is None else after):
        one = torch.ones((), device=A.device)
        out = torch._scaled_mm(A, B, one, one, out_dtype=torch.float32)
        return (out * scale_a * scale_b).to(out_dtype)
    return torch._scaled_mm(A, B, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


def _whole_tiles(a: Quantized, b: Quantized) -> bool:
    """torch's kernels take whole tiles only (tensor- and row-wise tiles always are; their K is
    padded to torch._scaled_mm's multiple of 16 in kernel_mm)."""
    return all(size % tile == 0 for q in (a, b) for size, tile in zip(q.data.shape, q.tile))


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, *, kernel: bool,
              fast_accum: bool = False, blockwise: bool | None = None, after: bool | None = None) -> torch.Tensor:
    """On torch's kernel (`kernel`) where the tiles are whole, else on the emulation. A
    Linear whose own dimensions are not whole tiles is logged at conversion
    (mixprec.narrow.convert); a micro-batch whose token count is not is said there too: no
    log line here, inside a compiled graph."""
    if kernel and _whole_tiles(a, b):
        return kernel_mm(a, b, out_dtype, fast_accum, blockwise, after)
    return emulated_mm(a, b, out_dtype)


@functools.lru_cache(maxsize=None)
def probe(device: str, a_tile: tuple[int, int], b_tile: tuple[int, int], a_dtype: torch.dtype,
          b_dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """None when torch has a kernel for this layout (tiles as `quantize` takes them, 0 for a
    whole dimension) on `device` that agrees with the emulation on a 512^3 problem (four
    128-blocks along each side, so block-wise scale strides are those of real shapes);
    otherwise the reason it is not used."""
    gen = torch.Generator().manual_seed(0)
    a, _ = quantize(torch.randn(512, 512, generator=gen).to(device), a_dtype, a_tile)
    b, _ = quantize(torch.randn(512, 512, generator=gen).to(device), b_dtype, b_tile)
    if "blockwise" in (layout(a, "a"), layout(b, "b")):
        if device == "cpu":
            return "torch has no block-wise scaled GEMM on the CPU"
        if not hasattr(F, "scaled_mm"):
            return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm for block-wise scales"
    try:
        got = kernel_mm(a, b, out_dtype).float()
    except Exception as e:  # noqa: BLE001 - whatever the kernel raises, the emulation is used and the reason logged
        return f"torch's scaled GEMM refused the layout ({str(e).splitlines()[0][:160]})"
    want = emulated_mm(a, b, torch.float32)
    err = float((got - want).norm() / want.norm().clamp(min=EPS))
    if not err < 1e-2:  # bfloat16 output rounding alone is about 2^-9 relative
        return f"torch's scaled GEMM disagrees with the emulation (relative error {err:.2g})"
    return None


def cpu_name() -> str:
    """torch's CPU capability, and AMX where the CPU has it (torch names AVX512 for both)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return f"{torch.backends.cpu.get_cpu_capability()}{' with AMX' if amx else ''}"


def _seconds(run) -> float:
    """The faster of two timed runs after one untimed (first-call set-up left out)."""
    run()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


@functools.lru_cache(maxsize=None)
def cpu_speed(a_tile: tuple[int, int], b_tile: tuple[int, int], a_dtype: torch.dtype, b_dtype: torch.dtype,
              out_dtype: torch.dtype) -> str | None:
    """None where torch's CPU scaled GEMM for this layout is CPU_MARGIN times faster than the emulation on a
    64 x 256 x 256 problem (said once with both figures), else why the emulation runs. The margin keeps the
    choice from turning on noise where both run at one speed: processes of one run choose alike."""
    gen = torch.Generator().manual_seed(0)
    a, _ = quantize(torch.randn(64, 256, generator=gen), a_dtype, a_tile)
    b, _ = quantize(torch.randn(256, 256, generator=gen), b_dtype, b_tile)
    try:
        kernel = _seconds(lambda: kernel_mm(a, b, out_dtype))
    except Exception:  # noqa: BLE001 - no kernel for the layout: `probe` says why
        return None
    emulated = _seconds(lambda: emulated_mm(a, b, out_dtype))
    said = (f"{kernel * 1e3:.2f} ms against the emulation's {emulated * 1e3:.2f} ms for a 64 x 256 x 256 "
            f"{layout(a, 'a')} {a_dtype} x {b_dtype} GEMM, {cpu_name()} CPU")
    if kernel * CPU_MARGIN <= emulated:
        logger.info("fp8: torch's CPU scaled GEMM runs: %s", said)
        return None
    return f"torch's CPU scaled GEMM is not {CPU_MARGIN}x faster than the emulation here ({said})"


def route_on(device: str, a_tile: tuple[int, int], b_tile: tuple[int, int], a_dtype: torch.dtype,
             b_dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """None where a GEMM of this layout runs on torch's kernel on `device`: one that agrees with the emulation
    (`probe`) and, on a CPU, is faster (`cpu_speed`, timed first: a slow kernel is not run on the large
    problem); otherwise why it is emulated."""
    if device == "cpu" and (slow := cpu_speed(a_tile, b_tile, a_dtype, b_dtype, out_dtype)) is not None:
        return slow
    return probe(device, a_tile, b_tile, a_dtype, b_dtype, out_dtype)
