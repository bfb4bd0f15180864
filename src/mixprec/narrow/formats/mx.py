"""Microscaled training recipes: MXFP8, NVFP4 and MXFP4, their casts (mixprec::mx_quantize, mx_transpose) and
stochastic-rounding keys; their GEMM is mixprec.narrow.gemm.mx, their Linear mixprec.narrow.linear.mx.

    mxfp8  e4m3 elements (e5m2 gradients as an option: "hybrid"), one E8M0 scale per 1x32
           block along the contracted dimension, the scale rounded up (RCEIL: no element
           saturates; the OCP spec's floor diverged at 8B parameters, 2506.08027)
    nvfp4  e2m1 elements, one E4M3 scale per 1x16 block under one FP32 scale per tensor;
           weights in 16x16 blocks (one copy serves W and W^T), gradients stochastically
           rounded, a 16x16 random Hadamard transform on the weight-gradient GEMM's operands,
           the last 15% of decoder blocks in bfloat16 (Transformer Engine's NVFP4BlockScaling,
           TorchTitan's rule)
    mxfp4  e2m1 elements, one E8M0 scale per 1x32 block (the Hadamard and rounding knobs
           as nvfp4's, all off)

Each GEMM quantises both operands along the dimension it sums over, from their high-precision
values: the forward x and W along K, the input gradient dy and W along N, the weight
gradient dy^T and x^T along M (the tokens). What is saved for backward is x^T in the format
(quantised in the forward, after the Hadamard transform where there is one) and, with 2-D
weight blocks, the quantised weight.

The GEMMs are emulated: both operands dequantised without NVFP4's tensor scale (each value
is then an element times a power of two or an e4m3 scale: exact in FP32, and in bfloat16 for
every block above ~2^-115, `Blocked.dequantize`), multiplied with FP32 accumulation, and the
product times the two tensor scales, as the hardware applies them. On CUDA the operands are
dequantised to bfloat16 and multiplied by torch's bfloat16 GEMM with an FP32 output
(`torch.mm(..., out_dtype=torch.float32)`, the tensor cores' rate); elsewhere in FP32. Both
give the same products: the results differ by the summation order only (`gemm_route`
decides, once per device, and the conversion's log line names it). torch has microscaled
GEMMs only on Blackwell (SM100, F.scaled_mm with BlockWise1x32 / BlockWise1x16 scales and
swizzled scale layouts); mixprec does not drive them (they cannot be tested here), so every
device runs the emulation and the conversion's log line says so.

Stochastic rounding draws its bits like bf16-sr's (random_bits16: a counter-based hash of the
element's index and a key); the key hashes the gradient's own bits (an integer sum, the
same in any summation order, on any device, eager or compiled), the layer and the operand:
reproducible, the same after a resume, and fresh at every step as the gradient changes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

import torch

from mixprec.errors import UserError
from mixprec.narrow.kernels import cuda_compiled
from mixprec.narrow.formats.microscaling import (E2M1, E4M3, E5M2, E8M0, ROUNDINGS, Blocked, hadamard_signs,
                                                 quantize_mx_bits, quantize_nvfp4_bits)
from mixprec.narrow.formats.recipe import FP8Recipe, Granularity, Tiles, register_recipe

HADAMARDS = ("none", "random", "deterministic")
SCALE_FORMATS = ("e8m0", "e4m3")
HADAMARD_SIZE = 16
HADAMARD_SIGNS_SEED = 0  # the random signs of the random Hadamard transform: fixed, as Transformer Engine's


@dataclass(frozen=True)
class MXRecipe(FP8Recipe):
    element: torch.dtype = E4M3
    """The elements' format: float8_e4m3fn (MXFP8) or float4_e2m1fn_x2 (FP4)."""
    scale_format: str = "e8m0"
    """e8m0: a power of two per block (MX); e4m3: an e4m3 scale per block under an FP32 tensor scale (NVFP4)."""
    scale_rounding: str = "ceil"
    """E8M0 scales: ceil (RCEIL, the amax never saturates), floor (the OCP v1.0 rule), even (torchao's: the amax rounded to the element's width first, then floor)."""
    weight_2d: bool = False
    """Weights in block x block tiles: one quantised copy serves the forward (W) and the input gradient (W^T)."""
    stochastic_gradients: bool = False
    """FP4 gradients rounded stochastically (unbiased), the other operands to nearest."""
    hadamard: str = "none"
    """The weight-gradient GEMM's operands transformed along the tokens by 16x16 Hadamard blocks: none, random
    (random signs), deterministic (Sylvester's matrix)."""
    four_over_six: bool = False
    """NVFP4: each block's amax mapped to 4 or to 6, whichever reconstructs the block better (2512.02010)."""
    keep_last_blocks: float = 0.0
    """The share of decoder blocks, counted from the last, whose Linear layers stay in the base mode."""

    def __post_init__(self):
        super().__post_init__()

        def check(ok, name, value, accepted):
            if not ok:
                raise UserError(f"fp8.{name}: bad value {value!r} for the {self.name} recipe; accepted: {accepted}")

        fp4 = self.element == E2M1
        check(self.element in (E4M3, E2M1), "element", self.element, "float8_e4m3fn, float4_e2m1fn_x2")
        check(self.scale_format in SCALE_FORMATS, "scale_format", self.scale_format, ", ".join(SCALE_FORMATS))
        check(self.scale_rounding in ROUNDINGS, "scale_rounding", self.scale_rounding, ", ".join(ROUNDINGS))
        check(self.hadamard in HADAMARDS, "hadamard", self.hadamard, ", ".join(HADAMARDS))
        check(0.0 <= self.keep_last_blocks < 1.0, "keep_last_blocks", self.keep_last_blocks, "a share in [0, 1)")
        check(self.block == (16 if self.nv else 32), "block", self.block, "16 (e4m3 scales), 32 (e8m0 scales)")
        check(fp4 or not (self.stochastic_gradients or self.hadamard != "none"),
              "stochastic_gradients" if self.stochastic_gradients else "hadamard",
              self.stochastic_gradients if self.stochastic_gradients else self.hadamard,
              "off for FP8 elements (stochastic rounding and Hadamard transforms are FP4 options)")
        check(self.nv or not (self.weight_2d or self.four_over_six), "weight_2d" if self.weight_2d else "four_over_six",
              True, "false for E8M0-scaled recipes (2-D weight blocks and 4-over-6 are NVFP4 options)")
        check(fp4 or self.grad_dtype in (E4M3, E5M2), "grad_dtype", self.grad_dtype, "float8_e4m3fn, float8_e5m2")

    # ---- what the recipe is ---------------------------------------------------------------
    def emulation(self, device: str) -> str:
        why = gemm_route(device)
        if why is None:
            return "bfloat16 GEMMs with FP32 output on the operands dequantised to bfloat16, exactly"
        return f"FP32 GEMMs on the dequantised operands; {why}"

    @property
    def nv(self) -> bool:
        return self.scale_format == "e4m3"

    @property
    def preset(self) -> str:
        return self.name

    @property
    def label(self) -> str:
        return self.name.upper()

    @property
    def saved_bytes(self) -> float:
        element = 0.5 if self.element == E2M1 else 1.0
        return element + 1.0 / self.block  # an 8-bit scale per block

    @property
    def operand_formats(self) -> tuple[set, set]:
        grads = self.grad_dtype if self.element == E4M3 else E2M1
        return {self.element}, {self.element, grads}

    @property
    def saved_weight_bytes(self) -> float:
        return self.saved_bytes if self.weight_2d else 0.0

    @property
    def tiles(self) -> Tiles:
        b = self.block
        w = (b, b) if self.weight_2d else (1, b)
        return Tiles((1, b), w, (1, b), None if self.weight_2d else (b, 1), (b, 1), (b, 1))

    @property
    def backward_fp32_copies(self) -> int:
        """FP32 copies of an activation a backward holds at once between operators: the
        widened gradient and the dequantised operands, and with the Hadamard transform its
        FP32 copies (measured with MemTracker on the debug flavor, 2026-11-26: 4 for e4m3
        elements, 3 for e2m1, 8 for e2m1 with the transform). The casts' own temporaries (e2m1's
        rounding) live inside mixprec::mx_quantize: fused away where it is compiled (CUDA); on a
        CPU it runs eagerly and they add to the peak unseen by MemTracker."""
        if self.element != E2M1:
            return 4
        return 8 if self.hadamard != "none" else 3

    def summary(self) -> str:
        fmt = "e2m1" if self.element == E2M1 else "e4m3"
        if self.nv:
            scale = f"e4m3 scales per {'16x16 weight, ' if self.weight_2d else ''}1x16 block and an FP32 tensor scale"
        else:
            scale = f"E8M0 scales per 1x32 block (rounded {self.scale_rounding})"
        extras = [e for e, on in (("e5m2 gradients", self.element == E4M3 and self.grad_dtype == E5M2),
                                  ("stochastically rounded gradients", self.stochastic_gradients),
                                  (f"{self.hadamard} Hadamard transform on the weight gradient",
                                   self.hadamard != "none"),
                                  ("4-over-6 block scales", self.four_over_six),
                                  (f"the last {self.keep_last_blocks:.0%} of blocks in the base mode",
                                   self.keep_last_blocks > 0)) if on]
        return ", ".join([f"{fmt} elements", scale] + extras)

    def with_options(self, **options) -> "MXRecipe":
        own = {f.name for f in fields(MXRecipe)} - {f.name for f in fields(FP8Recipe)} | {"grad_dtype"}
        defaults = FP8Recipe(name="", granularity=Granularity.TENSORWISE)
        for key, value in options.items():
            if key not in own and value != getattr(defaults, key, value):
                raise UserError(f"fp8.{key} = {value!r} applies to delayed scaling only; the {self.name} recipe "
                                "scales each block by its own amax (accepted: leave it out)")
        return replace(self, **{k: v for k, v in options.items() if k in own})

    # ---- the casts -------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, *, gradient: bool = False, key: torch.Tensor | None = None,
                 square: bool = False, amax: torch.Tensor | None = None, values: bool = False) -> Blocked:
        """x (R, C) in blocks along C (square: block x block tiles); gradient: the gradient's
        format, stochastically rounded with `key` where the recipe says so; amax: NVFP4's
        tensor amax when x is a shard of the tensor; values: also the dequantised operand of
        the emulated GEMM (Blocked.values), from the same pass. One operator (mixprec::mx_quantize)."""
        key = key if gradient and self.stochastic_gradients else None
        dtype = self.grad_dtype if gradient and self.element != E2M1 else self.element
        data, scale, ts, deq = torch.ops.mixprec.mx_quantize(x, dtype, self.block, self.scale_rounding, self.nv,
                                                              square, self.four_over_six, key, amax, values)
        block = (self.block, self.block) if square else (1, self.block)
        return Blocked(data, scale, block, ts if self.nv else None, tuple(x.shape), deq if values else None)

    def transform(self, device) -> torch.Tensor | None:
        """The column signs of the weight-gradient GEMM's Hadamard blocks (`rotate`), or None."""
        if self.hadamard == "none":
            return None
        return hadamard_signs(HADAMARD_SIZE, HADAMARD_SIGNS_SEED if self.hadamard == "random" else None, device)


# ---- the operators -------------------------------------------------------------------------
# A compiled model keeps each microscaled Linear in its graph: Inductor generates no code for
# float8_e8m0fnu and float4_e2m1fn_x2 tensors (torch 2.13), so the casts and the GEMM are
# operators whose tensors of those dtypes only pass between them. Inside, on CUDA, each runs a
# compiled function on the bytes (Blocked.bits: uint8 codes and exponents, which Inductor
# fuses: one kernel reads an operand and writes its elements and scales, one reads them and
# writes the bfloat16 operand of the GEMM); on a CPU the same functions run eagerly, the
# reference (tests/narrow/test_mx_ops.py compiles them on the CPU against it, bit for bit).
def _cast(x, element, block, rounding, nv, square, four_over_six, key, amax, values_dtype=None) -> Blocked:
    """The cast, and with values_dtype the dequantised GEMM operand from it (one fused kernel compiled).
    Made by Blocked's constructor: torch 2.11's Dynamo cannot return a NamedTuple made by _replace."""
    tile = (block, block) if square else (1, block)
    if nv:
        q = quantize_nvfp4_bits(x, block=tile, key=key, four_over_six=four_over_six, amax=amax)
    else:
        q = quantize_mx_bits(x, element, block=block, rounding=rounding, key=key)
    values = q.dequantize(with_tensor_scale=False, dtype=values_dtype) if values_dtype is not None else None
    return Blocked(q.data, q.scale, q.block, q.tensor_scale, q.shape, values)


def _operand_dtype(device_type: str) -> torch.dtype:
    """The emulated GEMM's operand dtype on a device (gemm_route: bfloat16 where its FP32-output GEMM is exact)."""
    return torch.bfloat16 if gemm_route(device_type) is None else torch.float32


def _transpose(data, scale) -> tuple[torch.Tensor, torch.Tensor]:
    t = Blocked(data, scale, (1, 1), None, (0, 0)).t()
    return t.data, t.scale


@torch.library.custom_op("mixprec::mx_quantize", mutates_args=())
def _mx_quantize(x: torch.Tensor, element: torch.dtype, block: int, rounding: str, nv: bool, square: bool,
                 four_over_six: bool, key: torch.Tensor | None, amax: torch.Tensor | None, values: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    device = x.device.type
    q = cuda_compiled.compiled(_cast, device)(x, element, block, rounding, nv, square, four_over_six, key, amax,
                                _operand_dtype(device) if values else None).typed()
    # as the fake function says: the operand contiguous (a slice of the padded blocks where x is
    # not whole blocks), MX's placeholder for the tensor scale an empty FP32 tensor
    return (q.data, q.scale, q.tensor_scale if q.tensor_scale is not None else x.new_empty(0, dtype=torch.float32),
            q.values.contiguous() if values else x.new_empty(0))


@_mx_quantize.register_fake
def _(x, element, block, rounding, nv, square, four_over_six, key, amax, values):
    (R, C), (br, bc) = x.shape, ((block, block) if square else (1, block))
    rows, cols = -(-R // br) * br, -(-C // bc) * bc
    data = x.new_empty((rows, cols // 2 if element == E2M1 else cols), dtype=element)
    scale = x.new_empty((rows // br, cols // bc), dtype=E4M3 if nv else E8M0)
    deq = x.new_empty((R, C), dtype=_operand_dtype(x.device.type)) if values else x.new_empty(0)
    # NVFP4's tensor scale: one, or one per row or block where `amax` gives one each (a stack of tensors)
    ts_shape = (amax.shape if amax is not None else ()) if nv else (0,)
    return data, scale, x.new_empty(ts_shape, dtype=torch.float32), deq


@torch.library.custom_op("mixprec::mx_transpose", mutates_args=())
def _mx_transpose(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor in square blocks, transposed (Blocked.t): the elements and scales of W^T."""
    q = Blocked(data, scale, (1, 1), None, (0, 0)).bits()
    t, ts = cuda_compiled.compiled(_transpose, data.device.type)(q.data, q.scale)
    # one row or column of blocks transposes to a view of its input (a contiguous (1, n) is one of (n, 1)):
    # an operator returns no alias of its inputs
    same = lambda a, b: a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # noqa: E731
    t, ts = (t.clone() if same(t, data) else t), (ts.clone() if same(ts, scale) else ts)
    return t.view(data.dtype), ts.view(scale.dtype)


@_mx_transpose.register_fake
def _(data, scale):
    rows, cols = data.shape
    packed = 2 if data.dtype == E2M1 else 1
    return data.new_empty((cols * packed, rows // packed)), scale.new_empty(scale.shape[::-1])


def transpose(q: Blocked) -> Blocked:
    """q in square blocks, transposed, as one operator."""
    assert q.block[0] == q.block[1], "only square blocks serve a tensor and its transpose"
    data, scale = torch.ops.mixprec.mx_transpose(q.data, q.scale)
    return Blocked(data, scale, q.block, q.tensor_scale, q.shape[::-1])


@functools.lru_cache(maxsize=None)
def gemm_route(device: str) -> str | None:
    """None where the emulated GEMMs run in bfloat16 with FP32 output on `device` (CUDA, with
    torch's mm.dtype: a 256 x 512 x 128 integer GEMM checked exact against float64);
    otherwise why they run in FP32."""
    if device != "cuda":
        return f"torch has no bfloat16 GEMM with an FP32 output on {device} devices"
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-64, 64, shape, generator=gen).float().to(device) for shape in ((256, 512), (128, 512)))
    try:  # integers below 2^7: exact in bfloat16, their products and sums exact in FP32
        got = torch.mm(a.bfloat16(), b.bfloat16().t(), out_dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - whatever torch raises, the FP32 GEMM is used and the reason logged
        return f"torch {torch.__version__} refused a bfloat16 GEMM with an FP32 output ({str(e).splitlines()[0][:120]})"
    if got.dtype != torch.float32 or not torch.equal(got, a.double().mm(b.double().t()).float()):
        return "torch's bfloat16 GEMM with an FP32 output did not sum exactly in FP32"
    return None


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers (int16 for 2-byte dtypes, int32 for 4): what a rounding key sums."""
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def mix_key(bit_sum: torch.Tensor, salt, role: int) -> torch.Tensor:
    """int32 keys from integer sums of a tensor's bits (int64), the layer's salt (an int, or an int64
    tensor of one per sum) and the operand: the same mixing for one tensor or a stack of experts."""
    z = bit_sum * 0x9E3779B1 + ((salt * 0x85EBCA77 + role * 0xC2B2AE3D) & 0xFFFFFFFF)
    z = z & 0xFFFFFFFF
    return (z - ((z >> 31) << 32)).to(torch.int32)


def _key(t: torch.Tensor, salt, role: int) -> torch.Tensor:
    """A 0-dim int32 key from the bits of `t` (an exact integer sum), the layer (an int, or a 0-dim int64
    tensor: MXLinear's) and the operand."""
    return mix_key(bits_of(t).long().sum(), 0 if salt is None else salt, role)


MICRO = Granularity.MICROSCALED
register_recipe(MXRecipe("mxfp8", MICRO, grad_dtype=E4M3, block=32))
register_recipe(MXRecipe("nvfp4", MICRO, block=16, element=E2M1, scale_format="e4m3", weight_2d=True,
                         stochastic_gradients=True, hadamard="random", keep_last_blocks=0.15))
register_recipe(MXRecipe("mxfp4", MICRO, block=32, element=E2M1))


def kept_blocks(n_blocks: int, share: float) -> int:
    """How many of the last decoder blocks a keep_last_blocks share keeps in the base mode."""
    return math.ceil(n_blocks * share - 1e-9) if share > 0 else 0
