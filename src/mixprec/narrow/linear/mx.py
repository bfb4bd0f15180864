"""The microscaled Linear: an FP8Linear whose three GEMMs run in a microscaled recipe (MXFP8, NVFP4, MXFP4;
mixprec.narrow.formats.mx), each GEMM's operands quantised along the dimension it sums over from their
high-precision values, the GEMMs emulated (mixprec.narrow.gemm.mx)."""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

from mixprec.narrow.formats.gathered import BACKWARD, FORWARD, gathered_copy
from mixprec.narrow.formats.microscaling import Blocked, byte_values, rotate
from mixprec.narrow.formats.mx import HADAMARD_SIZE, MXRecipe, _key, transpose
from mixprec.narrow.formats.recipe import GEMMS
from mixprec.narrow.gemm.mx import mx_mm
from mixprec.narrow.linear.fp8 import FP8Linear, Plan, register_linear


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x (R, C) with zero rows appended to a multiple of `multiple` (zeros add nothing to a GEMM over R)."""
    pad = -x.shape[0] % multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


class _MXMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, plan: Plan, salt):
        return _MXMatmul.gemm(*_MXMatmul.cast(ctx, x, weight, plan, salt), plan)

    @staticmethod
    def gemm(xq: Blocked, wq: Blocked, plan: Plan) -> torch.Tensor:
        return mx_mm(xq, wq, plan.compute_dtype)

    @staticmethod
    def cast(ctx, x: torch.Tensor, weight: torch.Tensor, plan: Plan, salt):
        """The forward GEMM's operands, with what backward reads saved on ctx (as _FP8Matmul.cast)."""
        r = plan.recipe
        # values=True: each GEMM operand dequantised in its cast's own pass (not kept for backward)
        xq = r.quantize(x, values=True)  # (M, K) along K
        wq = gathered_copy(weight, FORWARD) or r.quantize(weight, square=r.weight_2d, values=True)  # (N, K) along K
        h = r.transform(x.device)
        xt = _pad_rows(x, HADAMARD_SIZE).t() if h is not None else x.t()
        xt_q = r.quantize(rotate(xt, h) if h is not None else xt)  # (K, M) along M, for the weight gradient
        ctx.plan, ctx.salt, ctx.x_dtype = plan, salt, x.dtype
        ctx.blocks = (xt_q.block, xt_q.shape, wq.block, wq.shape)
        kept = wq if r.weight_2d else Blocked(None, None, None, None, None)
        ctx.save_for_backward(weight, xt_q.data, xt_q.scale, xt_q.tensor_scale, kept.data, kept.scale,
                              kept.tensor_scale)
        return xq, wq

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan, salt = ctx.plan, ctx.salt
        r = plan.recipe
        weight, xt_data, xt_scale, xt_ts, w_data, w_scale, w_ts = ctx.saved_tensors
        xt_block, xt_shape, w_block, w_shape = ctx.blocks
        xt = Blocked(xt_data, xt_scale, xt_block, xt_ts, xt_shape)
        dy = dy.contiguous()
        gq = r.quantize(dy, gradient=True, key=_key(dy, salt, 0), values=True)  # (M, N) along N
        if r.weight_2d:  # the forward's 16x16 blocks, transposed
            wq_t = transpose(Blocked(w_data, w_scale, w_block, w_ts, w_shape))
        else:
            wq_t = gathered_copy(weight, BACKWARD) or r.quantize(weight.t(), values=True)  # (K, N) along N
        dx = mx_mm(gq, wq_t, plan.compute_dtype).to(ctx.x_dtype)
        h = r.transform(dy.device)
        gt = _pad_rows(dy, HADAMARD_SIZE).t() if h is not None else dy.t()
        gt_q = r.quantize(rotate(gt, h) if h is not None else gt, gradient=True, key=_key(dy, salt, 1),
                          values=True)  # (N, M)
        dw = mx_mm(gt_q, xt, torch.float32).to(weight.dtype)
        return dx, dw, None, None


class MXLinear(FP8Linear):
    """An FP8Linear whose three GEMMs run in a microscaled recipe."""

    matmul = _MXMatmul

    @classmethod
    def from_linear(cls, linear, plan: Plan, fqn: str = "") -> "MXLinear":
        new = super().from_linear(linear, plan, fqn)
        # the layer's part of its stochastic-rounding keys, a tensor: an int attribute is a constant of the
        # compiled block, and every block's own salt would compile the block again (past Dynamo's limit of 8
        # recompiles the rest ran eagerly). Not persistent: derived from the name, not saved
        new._salt = zlib.crc32(fqn.encode())
        new.register_buffer("salt", torch.tensor(new._salt, dtype=torch.int64, device=linear.weight.device),
                            persistent=False)
        new._constants_on(linear.weight.device if linear.weight.device.type != "meta" else torch.device("cpu"))
        return new

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        device = self.weight.device
        if device.type != "meta":
            self.salt.fill_(self._salt)  # to_empty leaves the buffer's memory as it was
        self._constants_on(device)  # a model built on the meta device, then to_empty on a GPU
        return out

    def _constants_on(self, device) -> None:
        """The Hadamard signs and the decode table copied to `device` now, outside any compiled region
        and any step: copied inside the first compiled pass, the cache it fills would fail that graph's
        guard and compile the block a second time."""
        self.plan.recipe.transform(device)
        byte_values(device)

    def matmul_state(self):
        return self.salt

    @staticmethod
    def routes(recipe: MXRecipe, device: str, compute_dtype: torch.dtype) -> dict[str, str | None]:
        if device == "cuda" and torch.cuda.get_device_capability() >= (10, 0):
            why = ("torch's microscaled GEMMs on this Blackwell GPU are not driven by mixprec yet (untested without "
                   "one)")
        else:
            where = "a CPU" if device == "cpu" else f"this {device} device"
            why = f"torch has microscaled scaled GEMMs on Blackwell (SM100) GPUs only, not on {where}"
        return {g: why for g in GEMMS}


register_linear(MXRecipe, MXLinear)
