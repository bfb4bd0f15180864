"""Optimizer moments stored in 8 bits: an FP8 code and a block-wise dynamic 8-bit code.

A moment tensor of shape (..., n) is cut into blocks of `block_size` consecutive elements
along its last dimension (the last block of a row may be shorter); each block keeps its
absolute maximum as an FP32 scale, shape (..., ceil(n / block_size)). Blocks never span
rows, so a tensor split by rows (FSDP2 shards dimension 0) holds the same blocks on every
rank as in one process: the state's bits do not depend on the number of ranks.

- "fp8": e4m3 elements of x / s with s = absmax / 448 (the largest e4m3 value), rounded to
  nearest even by torch's cast; an element dequantizes to code * s.
- "8bit": the dynamic code of Dettmers et al. (8-bit optimizers via block-wise quantization,
  2022): 256 values in [-1, 1] (signed, the first moment) or [0, 1] (unsigned, the second),
  dense near zero; an element stores the index of the code value nearest to x / absmax
  (ties to the larger value) and dequantizes to code[index] * absmax.

Explicit edge cases: a block of zeros keeps the scale 0 and dequantizes to zeros; a block
holding an inf or NaN stores the scale NaN, so it dequantizes to NaN (never silently to a
finite value); the FP8 quotient is clamped to +-448 so a subnormal scale cannot overflow
the code.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from mixprec.errors import UserError

FP32, E4M3 = torch.float32, torch.float8_e4m3fn
E4M3_MAX = 448.0
DENSE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTIZED = ("fp8", "8bit")
NAMES = (*DENSE, *QUANTIZED)
SCALE = "_absmax"  # the state key of a moment's block scales: exp_avg -> exp_avg_absmax


def _real(build):
    """build(), real tensors even under a fake-tensor mode (the memory planner's step): the tables are
    constants, cached for the process, and read on the host where they are made."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return build()


def code_on(signed: bool, device) -> torch.Tensor:
    """dynamic_code(signed) on `device` (kept: a compiled kernel takes it as an argument)."""
    return _real(lambda: _code_on(signed, torch.device(device)))


@functools.cache
def _code_on(signed: bool, device: torch.device) -> torch.Tensor:
    return dynamic_code(signed).to(device)


@functools.cache
def dynamic_code(signed: bool) -> torch.Tensor:
    """The 256 sorted values of the dynamic 8-bit code, FP32 on the CPU. For each decade
    e = 0..6 below 1 (scale 10^(e-6)), the midpoints of k equal steps from 0.1 to 1, with
    k = 2^e (signed: with both signs) or 2^(e+1) (unsigned), then 0 and 1: 2 x 127 + 2 =
    256 values either way. Computed in FP32 (linspace, the midpoints, the decade's
    product), the values bitsandbytes and torchao use (tests/optim/test_state_formats.py)."""
    values = [torch.tensor([0.0, 1.0])]
    for e in range(7):
        steps = 2**e if signed else 2 ** (e + 1)
        edges = torch.linspace(0.1, 1, steps + 1)
        mids = ((edges[:-1] + edges[1:]) / 2.0) * (10.0 ** (e - 6))
        values += [mids, -mids] if signed else [mids]
    return torch.cat(values).sort().values  # tensors throughout: no host read where a first step builds it


def midpoints(signed: bool) -> torch.Tensor:
    """The 255 FP32 midpoints (code[i] + code[i + 1]) / 2: a value's code index is the number of
    midpoints it reaches (n >= midpoint: a tie goes to the larger code value)."""
    code = dynamic_code(signed)
    return (code[:-1] + code[1:]) / 2


@functools.cache
def _lookup(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tables on the upper 16 bits of an FP32 value (sign, exponent, 7 mantissa bits): how
    many midpoints lie at or below the smallest value those bits begin, and the next midpoint
    (inf where none). No bucket holds two midpoints, so a value's index is the first table's
    count, plus one where it reaches the second's midpoint: two independent table reads, not a
    search."""
    mids = midpoints(signed).double()
    buckets = torch.arange(65536, dtype=torch.int64)
    neg = buckets >= 0x8000
    starts, ends = buckets << 16, (buckets << 16) | 0xFFFF

    def values(bits):  # FP32 values of these bit patterns, as float64; NaN and inf outside [-1, 1] anyway
        as_int32 = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
        return torch.nan_to_num(as_int32.view(torch.float32).double(), nan=0.0, posinf=1.0, neginf=-1.0).clamp(-1, 1)

    lo = values(torch.where(neg, ends, starts))  # the smallest value of each bucket (negative: the last bits)
    hi = values(torch.where(neg, starts, ends))
    count = torch.searchsorted(mids, lo, right=True)
    inside = torch.searchsorted(mids, hi, right=True) - count
    assert int(inside.max()) <= 1, "a bucket holds two midpoints: the lookup needs a step more"
    nxt = torch.cat([mids, torch.tensor([math.inf], dtype=torch.float64)])[count]
    return count.to(torch.int32), nxt.float()


def lookup_on(signed: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """_lookup(signed)'s two tables on `device` (a compiled kernel takes them as arguments)."""
    return _real(lambda: _lookup_on(signed, torch.device(device)))


@functools.cache
def _lookup_on(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.to(device) for t in _lookup(signed))


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x as (rows, blocks, block_size), its last dimension zero-padded to whole blocks."""
    n = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, n)
    pad = -n % block_size
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.view(rows.shape[0], (n + pad) // block_size, block_size)  # no -1: an empty shard has 0 rows


def aligned(x: torch.Tensor, block_size: int) -> bool:
    """Whether x's rows are whole blocks: then its blocks are a view (no padding)."""
    return x.dim() > 0 and x.shape[-1] % block_size == 0


def scale_shape(shape: torch.Size | tuple, block_size: int) -> tuple[int, ...]:
    """The block scales' shape for a moment of `shape`: (..., ceil(n / block_size))."""
    shape = tuple(shape) or (1,)
    return (*shape[:-1], math.ceil(shape[-1] / block_size))


def quantize_blocks(blocks: torch.Tensor, fmt: str, signed: bool, table: tuple | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of FP32 blocks (rows, nb, block): codes alike, scales (rows, nb, 1).
    `table`: lookup_on(signed) (8bit only)."""
    absmax = blocks.abs().amax(-1, keepdim=True)  # NaN where the block holds one
    absmax = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, math.nan))
    zero = absmax == 0
    if fmt == "fp8":
        s = absmax / E4M3_MAX
        return torch.where(zero, 0.0, blocks / torch.where(zero, 1.0, s)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s
    if fmt != "8bit":
        raise ValueError(f"state format {fmt!r}: accepted {', '.join(QUANTIZED)}")
    n = torch.where(zero, 0.0, blocks / torch.where(zero, 1.0, absmax))
    # the number of midpoints n reaches: the count for n's upper bits, plus one where n reaches the bucket's next
    count, nxt = table
    bucket = (n.view(torch.int32) >> 16) & 0xFFFF
    return (count[bucket] + (n >= nxt[bucket]).int()).to(torch.uint8), absmax


def _values(codes: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The FP32 value each code stands for, before its block's scale."""
    return code[codes.long()] if codes.dtype == torch.uint8 else codes.float()


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """FP32 blocks of codes (rows, nb, block) and scales (rows, nb, 1)."""
    return _values(codes, code) * scales


def quantize(x: torch.Tensor, fmt: str, block_size: int, signed: bool = True,
             table: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of FP32 `x`: codes shaped as x (uint8 for "8bit", float8_e4m3fn for
    "fp8"), scales FP32 of scale_shape(x.shape). `table`: lookup_on(signed) on x's device, for
    compiled callers."""
    table = lookup_on(signed, x.device) if table is None and fmt == "8bit" else table
    q, s = quantize_blocks(_blocks(x.float(), block_size), fmt, signed, table)
    n = x.shape[-1] if x.dim() else 1
    codes = q.flatten(1)[:, :n].reshape(x.shape)
    return codes, s.reshape(scale_shape(x.shape, block_size))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block_size: int, signed: bool = True,
               code: torch.Tensor | None = None) -> torch.Tensor:
    """The FP32 values of (codes, scales); `code` as quantize's."""
    code = code_on(signed, codes.device) if code is None else code
    scales = scales.flatten(0, -2).unsqueeze(-1) if scales.dim() > 1 else scales.reshape(1, -1, 1)
    blocks = _blocks(_values(codes, code), block_size) * scales  # padded as FP32 values, not as codes
    n = codes.shape[-1] if codes.dim() else 1
    return blocks.flatten(1)[:, :n].reshape(codes.shape)


@dataclass(frozen=True)
class StateFormat:
    """How AdamW's two moments are stored: `name` one of fp32, bf16, fp16 (a dtype) or fp8,
    8bit (block-quantized, `block_size` elements per FP32 scale). Tensors with fewer than
    `min_size` elements, and embeddings unless `embeddings` is true, keep FP32 moments (as
    bitsandbytes advises: their moments are few and their updates sparse)."""
    name: str = "fp32"
    block_size: int = 256
    """Elements per block scale, along a tensor's last dimension."""
    min_size: int = 4096
    """Tensors with fewer elements keep FP32 moments."""
    embeddings: bool = False
    """Embeddings' moments in this format too (default: FP32)."""

    def __post_init__(self):
        name = str(self.name).strip().lower()
        name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8": "fp8", "int8": "8bit"}.get(name,
                                                                                                             name)
        if name not in NAMES:
            raise UserError(f"precision.optimizer_states: unknown format {self.name!r}; accepted: {', '.join(NAMES)}")
        object.__setattr__(self, "name", name)
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise UserError(f"precision.optimizer_state_block: {self.block_size!r}; accepted: a positive integer "
                            "(256: bitsandbytes' and torchao's)")
        if not isinstance(self.min_size, int) or self.min_size < 0:
            raise UserError(f"precision.optimizer_state_min_size: {self.min_size!r}; accepted: an integer >= 0")

    @classmethod
    def of(cls, value) -> StateFormat:
        """From a StateFormat, a name, or a dtype."""
        if isinstance(value, StateFormat):
            return value
        if isinstance(value, torch.dtype):
            value = {v: k for k, v in DENSE.items()}.get(value, str(value))
        return cls(str(value))

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED

    @property
    def dtype(self) -> torch.dtype:
        """The dense moments' dtype; a quantized format's codes: uint8 or float8_e4m3fn."""
        return DENSE.get(self.name) or (E4M3 if self.name == "fp8" else torch.uint8)

    @property
    def label(self) -> str:
        return f"{self.name} (blocks of {self.block_size})" if self.quantized else self.name

    def keeps_fp32(self, numel: int, embedding: bool, dim: int = 2) -> str | None:
        """Why a tensor of `numel` elements and `dim` dimensions keeps FP32 moments in this format, or None."""
        if not self.quantized:
            return None
        if numel < self.min_size:
            return f"fewer than {self.min_size} elements"
        if dim < 2:  # FSDP2 shards dimension 0, a 1-D tensor's blocks: FP32 in one process too, so that
            return "a 1-D tensor (its blocks would span FSDP2's shards)"  # checkpoints move between the two
        if embedding and not self.embeddings:
            return "an embedding"
        return None

    def bytes_per_element(self, shape) -> float:
        """Bytes one moment takes per element of a tensor of `shape` in this format (scales included)."""
        if not self.quantized:
            return self.dtype.itemsize
        numel = math.prod(shape) or 1
        return 1 + 4 * math.prod(scale_shape(shape, self.block_size)) / numel
