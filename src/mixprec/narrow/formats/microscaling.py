"""Microscaled formats: small blocks of FP8 or FP4 elements that share one scale.

    q = quantize_mx(x, E4M3, rounding="ceil")     # MXFP8: 1x32 blocks, one E8M0 scale each
    q = quantize_mx(x, E2M1)                      # MXFP4: the same with e2m1 elements
    q = quantize_nvfp4(x)                         # NVFP4: 1x16 blocks, E4M3 scales, one FP32 scale
    x_hat = q.dequantize()                        # FP32

Blocks run along a tensor's last dimension (the dimension its GEMM sums over: callers pass
W^T or x^T where a GEMM sums over the other one); NVFP4 weights may use 16x16 blocks, one
scale serving W and W^T alike. Everything is stored in torch's own dtypes: elements in
float8_e4m3fn/float8_e5m2 or float4_e2m1fn_x2 (two codes a byte, the first in the low
nibble), scales in float8_e8m0fnu (a biased power of two) or float8_e4m3fn.

The arithmetic follows the OCP MX spec v1.0 and NVIDIA's NVFP4 recipe in the operation order
torchao's mx_formats uses, so the elements and scales equal its bit for bit
(tests/narrow/test_microscaling.py), with two exceptions. For the round-up ("ceil", RCEIL) E8M0
scale, torchao takes ceil(log2(amax / max)) in FP32, and log2 of a value just above a power of
two (1 + 2^-20 and closer) rounds to the integer below; here the exponent comes from the bits,
as the hardware's cvt.rp instruction rounds (the test's adversarial blocks show the difference).
And a block at the smallest E8M0 scale (2^-127) is divided by that scale, as stored and as
the definition decodes it (torchao divides by 2^-126 there: such a block decodes to half its
value; tested against the definition).

Where the definitions leave room: NVFP4 block scales are held at 2^-6 or more (e4m3's
subnormal scales, which the format allows, are not used); an all-zero NVFP4 tensor gets the
tensor scale 1 (Transformer Engine's rule) and the tensor scale is held at 2^-120 or more,
so the cast's factor is finite.

Non-finite inputs: a NaN makes its block's scale the NaN code (MX) or the tensor's scale
NaN (NVFP4), so the whole block or tensor decodes NaN; an infinity in an MX block gives a
finite scale (the largest its exponent clamps to), its own element decodes non-finite and
the rest of the block to zero. Either way the step's non-finite check sees it; the element
codes of such blocks mean nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mixprec.narrow.formats.scaling import per_tile
from mixprec.rounding import random_bits16

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E2M1 = torch.float4_e2m1fn_x2  # two e2m1 codes per byte
E8M0 = torch.float8_e8m0fnu

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign
ELEMENT_MAX = {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}
ELEMENT_MAX_POW2 = {E4M3: 8, E5M2: 15, E2M1: 2}  # the exponent of each format's largest power of two
ELEMENT_MBITS = {E4M3: 3, E5M2: 2, E2M1: 1}
# the 23-bit FP32 mantissa of each format's largest value: 448 = 1.75 x 2^8, 57344 = 1.75 x 2^15, 6 = 1.5 x 2^2
_MAX_MANTISSA = {dtype: int((top / 2.0**ELEMENT_MAX_POW2[dtype] - 1) * 2**23) for dtype, top in ELEMENT_MAX.items()}
E8M0_BIAS = 127
ROUNDINGS = ("ceil", "floor", "even")  # E8M0 scale: amax/max rounded up (RCEIL), OCP v1.0's floor, torchao's floor after RNE
E4M3_TINY = 2.0**-6  # NVFP4 block scales are kept at or above e4m3's smallest normal
NVFP4_TENSOR_SCALE_MIN = 2.0**-120  # 1 / (2^-120 x 2^-6) = 2^126: the cast's factor stays finite


class Blocked(NamedTuple):
    """A microscaled tensor. data and scale are in torch's dtypes (float4_e2m1fn_x2, float8_e8m0fnu)
    wherever a user sees them; inside mixprec's ops they may be their bytes (uint8: packed e2m1
    codes, biased E8M0 exponents), the form Inductor compiles (`bits`)."""
    data: torch.Tensor  # float8 (R, C), or float4_e2m1fn_x2 (R, C/2)
    scale: torch.Tensor  # float8_e8m0fnu or float8_e4m3fn, one per block: (R/br, C/bc)
    block: tuple[int, int]  # (1, 32), (1, 16) or (16, 16)
    tensor_scale: torch.Tensor | None  # NVFP4's FP32 second level (0-dim), None for MX
    shape: tuple[int, int]  # (R, C) before padding to whole blocks
    values: torch.Tensor | None = None  # the GEMM's operand, dequantised without the tensor scale, where the cast made it

    def bits(self) -> "Blocked":
        """The same tensor with e2m1 data and E8M0 scales as their bytes (uint8)."""
        data = self.data.view(torch.uint8) if self.data.dtype == E2M1 else self.data
        scale = self.scale.view(torch.uint8) if self.scale.dtype == E8M0 else self.scale
        return self._replace(data=data, scale=scale)

    def typed(self) -> "Blocked":
        """bits() undone: uint8 data is packed e2m1, a uint8 scale is E8M0."""
        data = self.data.view(E2M1) if self.data.dtype == torch.uint8 else self.data
        scale = self.scale.view(E8M0) if self.scale.dtype == torch.uint8 else self.scale
        return self._replace(data=data, scale=scale)

    def elements(self) -> torch.Tensor:
        """The elements as FP32 values, before any scale: (R, C padded)."""
        if self.data.dtype in (E2M1, torch.uint8):
            return decode_e2m1(self.data.view(torch.uint8))
        return self.data.float()

    def _factors(self) -> torch.Tensor:
        """One FP32 scale per block (E8M0 decoded from its byte, as float8_e8m0fnu's .float())."""
        if self.scale.dtype in (E8M0, torch.uint8):
            return e8m0_values(self.scale.view(torch.uint8))
        return self.scale.float()

    def scales(self, with_tensor_scale: bool = True) -> torch.Tensor:
        """The FP32 factor of each element, (R, C padded)."""
        s = self._factors()
        if self.tensor_scale is not None and with_tensor_scale:
            s = s * self.tensor_scale
        return _spread(s, self.block)

    def dequantize(self, with_tensor_scale: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values this tensor stands for, (R, C), in `dtype`. Without the tensor scale each
        value is an element (at most 4 significant bits) times a power of two or an e4m3 scale:
        exact in FP32, and in bfloat16 (the product correctly rounded from exact factors) down
        to bfloat16's smallest subnormal, 2^-133: every block whose E8M0 scale is 2^-124 or
        more (e4m3 elements, amax above ~2^-115; 2^-117 for e5m2; every e2m1 block). A GEMM
        on them loses nothing before its FP32 accumulation."""
        R, C = self.shape
        factor = self._factors()
        if self.tensor_scale is not None and with_tensor_scale:
            factor = factor * self.tensor_scale
        return per_tile(torch.mul, self.elements().to(dtype), factor.to(dtype), self.block)[:R, :C]

    def t(self) -> "Blocked":
        """The transpose of a tensor in square blocks: the same elements and scales."""
        assert self.block[0] == self.block[1], "only square blocks serve a tensor and its transpose"
        if self.data.dtype in (E2M1, torch.uint8):
            data = pack(decode_codes(self.data.view(torch.uint8)).t().contiguous()).view(self.data.dtype)
        else:
            data = self.data.t().contiguous()
        return Blocked(data, self.scale.t().contiguous(), self.block, self.tensor_scale, self.shape[::-1],
                       None if self.values is None else self.values.t())


def _pad(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x (R, C) in FP32 with zeros appended to whole blocks (zeros change no amax)."""
    pr, pc = -x.shape[0] % block[0], -x.shape[1] % block[1]
    x = x.float()
    return F.pad(x, (0, pc, 0, pr)) if pr or pc else x.contiguous()


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| of each block, (R/br, C/bc); NaN where a block holds a NaN."""
    R, C = x.shape
    return x.abs().view(R // block[0], block[0], C // block[1], block[1]).amax(dim=(1, 3))


def _spread(s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """One value per block (R/br, C/bc) -> one per element (R, C) of whole blocks: a broadcast
    view of the (R/br, br, C/bc, bc) blocks, copied once by the reshape."""
    (nr, nc), (br, bc) = s.shape, block
    return s[:, None, :, None].expand(nr, br, nc, bc).reshape(nr * br, nc * bc)


# ---- e2m1 ------------------------------------------------------------------------------------
def round_e2m1(v: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 `v` (already scaled into [-6, 6]; beyond saturates) to e2m1 codes (uint8, 0-15).
    The grid's step is 0.5 below 2, 1 below 4, 2 up to 6, so a value is its step times an
    integer. Without `bits`: to nearest, ties to even (torch.round: the even multiple, which
    is the code whose mantissa bit is 0). With `bits` (16 random bits per element, int32): up
    with probability equal to the position between the two neighbours, so E[value] = v (to
    2^-16 of a step)."""
    mag = v.abs().clamp(max=6.0)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    if bits is None:
        q = torch.round(mag / step) * step  # exact: powers of two
    else:
        low = torch.floor(mag / step) * step
        up = bits.view(v.shape).float() < (mag - low) / step * 65536.0
        q = low + step * up
    code = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4))  # 0-7
    code = torch.where(torch.isnan(v), 7.0, code)  # NaN: the block's scale carries it
    sign = torch.signbit(v).to(torch.uint8) << 3  # a negative value that rounds to 0 is -0
    return code.to(torch.uint8) | sign


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) uint8 codes -> (R, C/2) uint8: element 2j in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def e8m0_values(exponents: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents (uint8, or int32 0-255) -> FP32 scales, as float8_e8m0fnu's .float():
    2^(e - 127), 0 the subnormal 2^-127, 255 NaN. From the bits (Inductor compiles no
    float8_e8m0fnu code)."""
    e = exponents.to(torch.int32)
    value = torch.where(e == 0, 1 << 22, e << 23).view(torch.float32)
    return torch.where(e == 255, float("nan"), value)


def decode_codes(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/2) uint8 -> (R, C) codes."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/2) uint8 -> (R, C) FP32 values, both nibbles of a byte looked up at once."""
    return byte_values(packed.device)[packed.long()].flatten(-2)


def byte_values(device) -> torch.Tensor:
    """The decode table on `device`, copied there once (MXLinear asks when it is made): a copy
    in every pass would make the host wait each time."""
    key = str(torch.device(device))
    table = _BYTE_VALUES_ON.get(key)
    if table is None:
        table = _BYTE_VALUES_ON[key] = _BYTE_VALUES.to(device)
    return table


def _byte_values() -> torch.Tensor:
    """(256, 2): the two e2m1 values of each byte, the low nibble first."""
    grid = torch.tensor(E2M1_GRID)
    codes = torch.arange(256)
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1)
    return torch.where(nibbles >= 8, -grid[nibbles & 7], grid[nibbles & 7])


_BYTE_VALUES = _byte_values()
_BYTE_VALUES_ON: dict[str, torch.Tensor] = {"cpu": _BYTE_VALUES}  # device -> the table there


def _to_elements(v: torch.Tensor, dtype: torch.dtype, key=None) -> torch.Tensor:
    """Scaled FP32 values, saturated, in the element format (clamp keeps NaN), e2m1 as packed
    bytes (uint8); with `key` (FP4 only), stochastically rounded with random_bits16's bits for
    that key: a 0-dim key for elements 0..n-1 of v, or (index, key) tensors giving each element
    of v its own (a stack of tensors cast as one: mixprec.narrow.experts.mx)."""
    limit = ELEMENT_MAX[dtype]
    v = v.clamp(-limit, limit)
    if dtype == E2M1:
        if isinstance(key, tuple):
            bits = random_bits16(key[0], key[1], v.device)
        else:
            bits = None if key is None else random_bits16(v.numel(), key, v.device)
        return pack(round_e2m1(v, bits))
    return v.to(dtype)


# ---- MX: E8M0 scales ------------------------------------------------------------------------
def e8m0_exponent(amax: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The biased E8M0 exponent (int32, 0-255; 255 is NaN) of each block's scale.
    ceil: 2^ceil(log2(amax / max)), the smallest power of two that keeps the block within the
          format (no element saturates), from the bits of amax;
    floor: 2^(floor(log2(amax)) - emax), OCP's rule: the top of the block may saturate;
    even: floor after rounding amax to the element's mantissa width (torchao's choice, not OCP's)."""
    bits = amax.view(torch.int32)
    if rounding == "ceil":
        # amax = m 2^E and max = m_max 2^emax (m, m_max in [1, 2)): amax <= max 2^k first holds
        # at k = E - emax, or one above where m > m_max (m/m_max is then in (1, 2)). From the
        # bits, as the hardware's cvt.rp rounds, and with no division (which Triton emits
        # approximately on CUDA: a quotient one ulp above a power of two would round up). A
        # subnormal amax (E below -126) gives a k far below -127, the clamp's floor.
        biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        exp = biased - E8M0_BIAS - ELEMENT_MAX_POW2[dtype] + (mantissa > _MAX_MANTISSA[dtype]).int()
        exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        return torch.where(torch.isnan(amax), 255, torch.where(torch.isinf(amax), 254, exp))
    if rounding == "even":  # round amax's mantissa to the element's width first (a carry may bump the exponent)
        bits = (bits + (1 << (22 - ELEMENT_MBITS[dtype]))) & (0x1FF << 23)
    exp = ((bits >> 23) & 0xFF) - E8M0_BIAS - ELEMENT_MAX_POW2[dtype]
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return torch.where(torch.isnan(amax), 255, exp)


def quantize_mx(x: torch.Tensor, dtype: torch.dtype, *, block: int = 32, rounding: str = "ceil",
                key: torch.Tensor | None = None) -> Blocked:
    """x (R, C) in blocks of 1 x `block` along C, one E8M0 scale per block.
    key: a 0-dim int32 key for stochastic rounding of e2m1 elements (None: to nearest)."""
    return quantize_mx_bits(x, dtype, block=block, rounding=rounding, key=key).typed()


def quantize_mx_bits(x: torch.Tensor, dtype: torch.dtype, *, block: int = 32, rounding: str = "ceil",
                     key: torch.Tensor | None = None) -> Blocked:
    """quantize_mx with its e2m1 data and E8M0 scales as bytes (Blocked.bits)."""
    shape, tile = tuple(x.shape), (1, block)
    x = _pad(x, tile)
    amax = _block_amax(x, tile)
    exp = e8m0_exponent(amax, dtype, rounding)
    # x times 2^(127 - exp), the reciprocal of the stored scale 2^(exp - 127), built from its
    # bits as an E8M0 value (254 - exp): exact on every backend, where a division may not be
    # (Triton's default fp32 division on CUDA is approximate). 2^127 for the smallest scale
    # 2^-127 (torchao divides by 2^-126 there, and such a block decodes to half its value),
    # FP32's subnormal 2^-127 for exp 254 (an infinite amax's), NaN for the NaN code.
    factor = torch.where(exp == 255, float("nan"), e8m0_values(E8M0_BIAS * 2 - exp))
    scaled = per_tile(torch.mul, x, factor, tile)
    return Blocked(_to_elements(scaled, dtype, key), exp.to(torch.uint8), tile, None, shape)


# ---- NVFP4: E4M3 block scales under one FP32 tensor scale ------------------------------------
def nvfp4_tensor_scale(amax: torch.Tensor, top: float = 6.0) -> torch.Tensor:
    """The FP32 second-level scale: amax / (448 * top), so the largest block scale fits e4m3.
    An all-zero tensor gets 1 (Transformer Engine's rule: its elements and block scales then
    decode to zeros instead of 0/0). The scale is held at NVFP4_TENSOR_SCALE_MIN or more, so
    that the cast's factor 1 / (tensor scale x block scale) stays finite (block scales are
    2^-6 or more); below amax = 2^-120 * 448 * top the block scales still fit e4m3 (each is
    at most amax / top / 2^-120 < 448), and values under 2^-127 flush to zero. A NaN or
    infinite amax stays non-finite."""
    amax = amax.float()
    ts = (amax / (ELEMENT_MAX[E4M3] * top)).clamp(min=NVFP4_TENSOR_SCALE_MIN)
    return torch.where(amax == 0, 1.0, ts)


def quantize_nvfp4(x: torch.Tensor, *, block: tuple[int, int] = (1, 16), tensor_scale: bool = True,
                   key: torch.Tensor | None = None, four_over_six: bool = False,
                   amax: torch.Tensor | None = None) -> Blocked:
    """x (R, C) in e2m1 blocks of 1x16 (or 16x16 for weights), an E4M3 scale per block
    mapping its amax to 6, and (tensor_scale) one FP32 scale for the whole tensor.

    four_over_six: each block also tries mapping its amax to 4 instead of 6 (a finer grid
    for its large values: 4/6 of the step) and keeps whichever reconstructs the block with the
    smaller squared error. The tensor scale then maps the tensor's amax to 448 x 4, so both
    choices fit e4m3. key: as quantize_mx's, for stochastic rounding. amax: the tensor's amax
    when x is a shard of it (the low-precision all-gather casts each rank's rows alone)."""
    return quantize_nvfp4_bits(x, block=block, tensor_scale=tensor_scale, key=key, four_over_six=four_over_six,
                               amax=amax).typed()


def quantize_nvfp4_bits(x: torch.Tensor, *, block: tuple[int, int] = (1, 16), tensor_scale: bool = True,
                        key: torch.Tensor | None = None, four_over_six: bool = False,
                        amax: torch.Tensor | None = None) -> Blocked:
    """quantize_nvfp4 with its e2m1 data as bytes (Blocked.bits)."""
    shape = tuple(x.shape)
    x = _pad(x, block)
    tensor_amax = x.abs().amax() if amax is None else amax
    amax = _block_amax(x, block)
    ts = nvfp4_tensor_scale(tensor_amax, 4.0 if four_over_six else 6.0) if tensor_scale else None
    tops = (6.0, 4.0) if four_over_six else (6.0,)
    best = None
    for top in tops:
        q = _nvfp4_with_top(x, amax, ts, block, top, key, shape)
        if best is None:
            best = q
            continue
        err_best = _block_sq_error(x, best, block)
        err = _block_sq_error(x, q, block)
        take = err < err_best  # per block; ties keep 6
        # the scales chosen through FP32 (exact both ways): Inductor promotes no bool with float8 in torch.where
        scale = torch.where(take, q.scale.float(), best.scale.float()).to(E4M3)
        best = Blocked(_choose_elements(best.data, q.data, take, block), scale, block, ts, shape)
    return best


def _nvfp4_with_top(x, amax, ts, block, top, key, shape) -> Blocked:
    limit = ELEMENT_MAX[E4M3]
    if ts is None:
        s = (amax / top).clamp(E4M3_TINY, limit).to(E4M3)
        recip = 1.0 / s.float()
    else:
        s = ((amax / top) / ts).clamp(E4M3_TINY, limit).to(E4M3)
        recip = (1.0 / ts) / s.float()
    return Blocked(_to_elements(per_tile(torch.mul, x, recip, block), E2M1, key), s, block, ts, shape)


def _block_sq_error(x: torch.Tensor, q: Blocked, block) -> torch.Tensor:
    d = (x - q.elements() * q.scales()) ** 2
    R, C = d.shape
    return d.view(R // block[0], block[0], C // block[1], block[1]).sum(dim=(1, 3))


def _choose_elements(a: torch.Tensor, b: torch.Tensor, take_b: torch.Tensor, block) -> torch.Tensor:
    ca, cb = decode_codes(a), decode_codes(b)
    return pack(torch.where(_spread(take_b, block), cb, ca))


# ---- Hadamard transforms ---------------------------------------------------------------------
def hadamard_signs(n: int = 16, seed: int | None = None, device=None) -> torch.Tensor:
    """(n,) column signs of a random Hadamard transform drawn from `seed`; all +1 for None
    (Sylvester's matrix itself: the deterministic transform). Drawn on the CPU once, copied
    to each device once (kept: a copy per pass would be a blocking copy per layer per step)."""
    if seed is None:
        return torch.ones(n, device=device)
    drawn = _SIGNS.get((n, seed, "cpu"))
    if drawn is None:  # (MXLinear draws it when made: a Generator cannot be traced by torch.compile)
        gen = torch.Generator().manual_seed(seed)
        drawn = _SIGNS[(n, seed, "cpu")] = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).float()
    key = (n, seed, str(torch.device(device)) if device is not None else "cpu")
    signs = _SIGNS.get(key)
    if signs is None:
        signs = _SIGNS[key] = drawn.to(device)
    return signs


_SIGNS: dict[tuple, torch.Tensor] = {}  # (n, seed, device) -> the signs there


def hadamard(n: int = 16, signs: torch.Tensor | None = None) -> torch.Tensor:
    """The n x n orthonormal matrix diag(signs) H (H Sylvester's), FP32: what `rotate`
    multiplies by. H @ H.T = I."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    # the signs flip the input before the mixing (diag(signs) H): after it they would cancel
    # between the two operands of the GEMM and change no cast (every cast is sign-symmetric)
    return (signs.cpu()[:, None] if signs is not None else 1.0) * h / n**0.5


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x (R, C) times the block-diagonal matrix of hadamard(n, signs) blocks along C (C a
    multiple of n), by the fast Walsh-Hadamard transform: log2(n) rounds of sums and
    differences, no GEMM (the audit then sees a microscaled layer's GEMMs only). Applied to
    both operands along the dimension a GEMM sums over it cancels in the product,
    (A Q)(B Q)^T = A B^T, and spreads an outlier over n elements before the cast."""
    n = signs.numel()
    R, C = x.shape
    y = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(-1, n) * signs.to(x.device)
    h = 1
    while h < n:  # pairs h apart within blocks of 2h: (a + b, a - b)
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return (y.view(-1, n) / n**0.5).view(R, C)
