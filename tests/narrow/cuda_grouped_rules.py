"""The rules torch's CUDA kernels apply to its grouped GEMMs (torch._grouped_mm, torch._scaled_grouped_mm,
sm_90, torch 2.11), applied on the CPU, whose kernels check only part of them, to every call with its
real offsets: what a GPU would refuse, or assert on the device (which ends the process), fails here.

    with CudaGroupedRules() as rules:     # every grouped GEMM inside is checked; rules.calls lists them
        ...

From torch's sources (GroupedBlas.cpp, GroupMMCommon.cuh, GroupedMMUtils.h):
- fewer than 1,024 groups (TORCH_CHECK(group_count < 1024));
- each operand row-major (unit last stride, row stride >= the row, a multiple of 16 bytes) or column-major
  (the same of its transpose), torch's order of the two tests; a 3-D operand's batch stride and the first
  element on 16 bytes (TMA);
- 2-D x 2-D (the summed dimension split by offs): unless a is column-major and b row-major, every group
  positive (CUTLASS cannot take an empty one) and every group but the last a multiple of 16 bytes
  (CUDA_KERNEL_ASSERT in prepare_grouped_gemm_data);
- 2-D x 3-D with a column-major a, and 3-D x 2-D with a row-major b: every group but the last aligned so;
- the scaled GEMM: a row-major, b column-major, a's last and b's two dimensions multiples of 16.
Element sizes are CUDA's: a float32 operand is what mixprec widens to bfloat16 there (the CPU's stand-in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

GROUPED = {torch.ops.aten._grouped_mm.default: False, torch.ops.aten._scaled_grouped_mm.default: True}


class GroupedRuleError(AssertionError):
    pass


def _element_size(t: torch.Tensor) -> int:
    return 2 if t.dtype == torch.float32 else t.element_size()  # float32: CUDA's bfloat16


def column_major(t: torch.Tensor, name: str) -> bool:
    """torch's check_valid_strides_and_return_transposed at CUDA's element size: True for column-major."""
    align = 16 // _element_size(t)
    (rows, cols), (s_rows, s_cols) = t.shape[-2:], t.stride()[-2:]
    if t.storage_offset() % align:
        raise GroupedRuleError(f"{name}: data_ptr not on 16 bytes (offset {t.storage_offset()})")
    if t.dim() == 3 and t.stride(0) % align:
        raise GroupedRuleError(f"{name}: batch stride {t.stride(0)} not a multiple of 16 bytes")
    if s_rows == 1 and s_cols >= max(1, rows):
        if s_cols % align:
            raise GroupedRuleError(f"{name} {tuple(t.shape)} {t.stride()}: strides should be multiple of 16 bytes")
        return True
    if s_cols == 1 and s_rows >= max(1, cols):
        if s_rows % align:
            raise GroupedRuleError(f"{name} {tuple(t.shape)} {t.stride()}: strides should be multiple of 16 bytes")
        return False
    raise GroupedRuleError(f"{name}: invalid strides {t.stride()} for sizes {tuple(t.shape)}")


def check(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, scaled: bool) -> dict:
    """Every rule for one call; returns what was checked (layouts, group count, sizes)."""
    a_col, b_col = column_major(a, "a"), column_major(b, "b")
    kind = f"{a.dim()}d x {b.dim()}d"
    groups = offs.shape[0] if a.dim() == 2 and b.dim() == 2 else (b.shape[0] if a.dim() == 2 else a.shape[0])
    if groups >= 1024:
        raise GroupedRuleError(f"{kind}: {groups} groups; CUDA takes fewer than 1,024")
    if scaled:
        if a_col or not b_col:
            raise GroupedRuleError(f"scaled {kind}: a must be row-major and b column-major")
        if a.shape[-1] % 16 or b.shape[-2] % 16 or b.shape[-1] % 16:
            raise GroupedRuleError(f"scaled {kind}: dimensions {tuple(a.shape)}, {tuple(b.shape)} not multiples of 16")
    sizes = []
    if offs is not None and offs.device.type != "meta":
        ends = offs.long().tolist()
        sizes = [e - s for s, e in zip([0] + ends[:-1], ends)]
        if any(n < 0 for n in sizes):
            raise GroupedRuleError(f"{kind}: offsets decrease {ends}")
        align_a, align_b = 16 // _element_size(a), 16 // _element_size(b)
        need = []  # (what, alignment, positive)
        if a.dim() == 2 and b.dim() == 2 and not (a_col and not b_col):
            need = [("a", align_a if not a_col else 1, True), ("b", align_b if b_col else 1, True)]
        elif a.dim() == 2 and b.dim() == 3 and a_col:
            need = [("a", align_a, False)]
        elif a.dim() == 3 and b.dim() == 2 and not b_col:
            need = [("b", align_b, False), ("out", 8, False)]
        for what, align, positive in need:
            if positive and any(n <= 0 for n in sizes):
                raise GroupedRuleError(f"{kind} ({'col' if a_col else 'row'} a, {'col' if b_col else 'row'} b): "
                                       f"an empty group in {sizes} (only column-major a with row-major b takes one)")
            bad = [n for n in sizes[:-1] if n % align]
            if bad:
                raise GroupedRuleError(f"{kind} ({'col' if a_col else 'row'} a, {'col' if b_col else 'row'} b): "
                                       f"groups {bad} of {what} not multiples of 16 bytes ({align} elements)")
    return {"kind": kind, "a": "col" if a_col else "row", "b": "col" if b_col else "row", "groups": groups,
            "sizes": sizes, "scaled": scaled}


class CudaGroupedRules(TorchDispatchMode):
    """Checks every torch grouped GEMM: those dispatched at the top (autograd's included) through this mode,
    those inside mixprec's operators (whose insides no mode sees) through torch's Python entry points."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []
        self._saved = {}

    def _wrap(self, fn, scaled):
        def checked(a, b, *args, offs=None, **kwargs):
            if scaled:  # torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=...)
                offs = offs if offs is not None else kwargs.get("offs")
            self.calls.append(check(a, b, offs, scaled))
            return fn(a, b, *args, offs=offs, **kwargs)
        return checked

    def __enter__(self):
        for owner, name, scaled in ((torch, "_grouped_mm", False), (F, "grouped_mm", False),
                                    (torch, "_scaled_grouped_mm", True)):
            if hasattr(owner, name):
                self._saved[(owner, name)] = getattr(owner, name)
                setattr(owner, name, self._wrap(getattr(owner, name), scaled))
        return super().__enter__()

    def __exit__(self, *exc):
        for (owner, name), fn in self._saved.items():
            setattr(owner, name, fn)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GROUPED:
            scaled = GROUPED[func]
            offs = kwargs.get("offs", args[4] if scaled and len(args) > 4 else args[2] if len(args) > 2 else None)
            self.calls.append(check(args[0], args[1], offs, scaled))
        return func(*args, **kwargs)
