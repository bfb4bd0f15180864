"""The weight of a low-precision Linear as FSDP2 all-gathers it in its narrow format
(mixprec.narrow.fsdp.linear): the gathered bytes, read by the Linear's GEMMs as they are."""

from __future__ import annotations

import torch

from mixprec.narrow.formats.microscaling import E2M1, E8M0, Blocked
from mixprec.narrow.formats.scaling import Quantized

FORWARD, BACKWARD = "forward", "backward"
aten = torch.ops.aten


class GatheredWeight(torch.Tensor):
    """The all-gathered weight (N, K) in its narrow format: what FSDP2 sets as the Linear's
    weight between unshard and reshard. Its dtype is the compute dtype (the gradient's);
    its bytes are the gathered buffers. The Linear's GEMMs read `copy(pass)`."""

    @staticmethod
    def __new__(cls, data, scale, meta, how: tuple, dtype: torch.dtype):
        shape = how[1]
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=data.device, requires_grad=False)

    def __init__(self, data, scale, meta, how: tuple, dtype: torch.dtype):
        self._data, self._scale, self._meta = data, scale, meta
        self._how = how  # (kind, (N, K), block, element dtype)

    def __tensor_flatten__(self):
        return [n for n in ("_data", "_scale", "_meta") if getattr(self, n) is not None], (self._how, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        how, dtype = spec
        return GatheredWeight(inner["_data"], inner.get("_scale"), inner.get("_meta"), how, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = args[0]
        if func in (aten.detach.default, aten.alias.default) or (
                func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(w.shape)):
            return GatheredWeight(w._data, w._scale, w._meta, w._how, w.dtype)
        raise RuntimeError(f"{func} on a weight all-gathered in its narrow format: only mixprec's low-precision "
                           "Linear reads it (set parallelism.lowp_all_gather = false to gather in bfloat16)")

    def __repr__(self):
        return f"GatheredWeight({self._how[0]}, {tuple(self.shape)}, {self._data.dtype})"

    def copy(self, which: str) -> Quantized | Blocked:
        """The quantised weight the `which` pass's GEMM reads: forward (W, scaled along K) or
        backward (for the input gradient: scaled along N where the recipe does so)."""
        k, (N, K), b, element = self._how
        if k == "tensor":
            return Quantized(self._data, self._meta.reshape(1, 1), (N, K))
        if k == "block":
            return Quantized(self._data, self._scale, (b, b))
        if k == "nv16":
            return Blocked(self._data, self._scale, (b, b), self._meta, (N, K))
        if k == "row":
            if which == FORWARD:
                return Quantized(self._data, self._scale[:, :1], (1, K))
            return Quantized(self._data, self._scale.reshape(-1)[:K].reshape(1, K), (N, 1))
        if which == FORWARD:  # mx
            return Blocked(self._data, self._scale, (1, b), None, (N, K))
        rows = N // 2 if element == E2M1 else N  # e2m1 packs two rows of W^T's columns per byte
        data = self._data.view(torch.uint8).view(rows, K).t().contiguous().view(self._data.dtype)
        scale = self._scale.view(torch.uint8).view(N // b, K).t().contiguous().view(E8M0)
        return Blocked(data, scale, (1, b), None, (K, N))


def gathered_copy(weight: torch.Tensor, which: str) -> Quantized | Blocked | None:
    """The weight's gathered narrow copy for `which` pass, or None for a weight to quantise."""
    return weight.copy(which) if isinstance(weight, GatheredWeight) else None


def gathered_experts(weight: torch.Tensor, which: str) -> Quantized | Blocked | None:
    """Every expert's gathered narrow copy for `which` pass, stacked, where `weight` is an experts
    projection all-gathered in its narrow format (mixprec.narrow.fsdp.experts.GatheredExperts); else None."""
    return weight.stacked(which) if hasattr(type(weight), "stacked") else None
