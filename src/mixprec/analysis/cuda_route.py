"""CUDA's route of mixprec's operators, traced on the meta device on any machine: what a GPU would dispatch and
allocate inside an operator whose fake function says only what it returns.

    with as_on_cuda(), Opened():                   # mixprec's operators run what they run inside, as CUDA runs it
        out = torch.ops.mixprec.experts_mm(x, w, offs, *key)  # x, w, offs on "meta"; key: ops.register's
    inside_peak(op, args)                          # the most bytes an operator holds at once inside, on CUDA

As CUDA runs it: a function the code compiles there (mixprec.narrow.kernels.cuda_compiled) is one fused kernel, which
allocates its outputs and nothing else; the microscaled GEMMs' operands are bfloat16 (CUDA's emulated GEMM);
an experts projection takes the kernels a Hopper GPU has for its recipe (`mixprec.narrow.experts.routes.on_hopper`);
a Triton kernel (`ONE_KERNEL`) is one launch that allocates its outputs.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

ONE_KERNEL = {"grouped_blockwise_mm", "grouped_blockwise_wgrad"}  # Triton kernels: one launch each
EXPERTS_OPS = {"experts_mm", "experts_mm_backward", "experts_mm_cast_input", "experts_mm_cast_input_backward"}
_PEAKS: dict = {}  # (operator, its arguments' shapes) -> bytes


def _one_kernel(on_kernel=None):
    """cuda_compiled.compiled as CUDA runs it: fn's outputs allocated (where a dispatch mode sees them), its
    intermediates never; on_kernel(fn, args, out): told of each such kernel."""
    def compiled(fn, device_type):
        def run(*args):
            with _disable_current_modes():
                out = fn(*args)
            if on_kernel is not None:
                on_kernel(fn, args, out)
                return out
            ins = {id(a) for a in tree_leaves(args)}  # an output written in place is no allocation
            return tree_map_only(torch.Tensor, lambda t: t if id(t) in ins else torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device=t.device), out)
        return run
    return compiled


@contextlib.contextmanager
def as_on_cuda(on_kernel=None):
    """While it lasts, cuda_compiled's functions as one kernel each (`_one_kernel`) and the microscaled GEMMs'
    operand dtype bfloat16, as on CUDA (for tensors on meta)."""
    from mixprec.narrow.kernels import cuda_compiled
    from mixprec.narrow.formats import mx

    saved = cuda_compiled.compiled, mx._operand_dtype
    cuda_compiled.compiled = _one_kernel(on_kernel)
    mx._operand_dtype = lambda device_type: torch.bfloat16  # CUDA's: bfloat16 GEMMs with an FP32 output
    try:
        yield
    finally:
        cuda_compiled.compiled, mx._operand_dtype = saved


def inside(func):
    """The Python function a mixprec operator runs inside, where it is to be opened (not one kernel), else None."""
    name = func.overloadpacket.__name__
    if func.namespace != "mixprec" or name in ONE_KERNEL:
        return None
    return torch._library.custom_ops.OPDEFS[f"mixprec::{name}"]._init_fn


class Opened(TorchDispatchMode):
    """mixprec's operators run what they run inside (a Triton kernel of ONE_KERNEL excepted), so that the modes
    below it see every operator and allocation; the experts projections on a Hopper GPU's route."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fn = inside(func)
        if fn is None:
            return func(*args, **kwargs)
        with Opened(), _on_hopper(func.overloadpacket.__name__, args):
            return fn(*args, **kwargs)


@contextlib.contextmanager
def _on_hopper(name: str, args):
    """An experts operator's projection (its last integer argument, the registry's key) as Hopper runs it."""
    from mixprec.narrow.experts import ops as experts
    from mixprec.narrow.experts.routes import on_hopper

    if name not in EXPERTS_OPS:
        yield
        return
    key = next(a for a in args if isinstance(a, int) and not isinstance(a, bool))
    saved = experts._GEMMS[key]
    experts._GEMMS[key] = on_hopper(saved)
    try:
        yield
    finally:
        experts._GEMMS[key] = saved


def _signature(a):
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), a.stride(), a.dtype
    return a


def inside_peak(func, args) -> int:
    """The most bytes the operator `func` holds at once inside (its outputs included, its inputs not) when it
    runs `args` (their shapes, dtypes and strides; values unread) along CUDA's route: traced on meta once per
    shape under torch's MemTracker."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed._tools.mem_tracker import MemTracker

    key = (str(func), tuple(_signature(a) for a in tree_leaves(args)))
    if key not in _PEAKS:
        with unset_fake_temporarily(), _disable_current_modes():
            meta = tree_map(lambda a: torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                            if isinstance(a, torch.Tensor) else a, args)
            tracker = MemTracker()
            with as_on_cuda(), tracker, Opened():
                func(*meta)  # its outputs dropped at once: the peak is what it held inside
            _PEAKS[key] = int(tracker.get_tracker_snapshot("peak").get(torch.device("meta"), {}).get("Total", 0))
    return _PEAKS[key]


class Workspaces(TorchDispatchMode):
    """mixprec's experts operators, each allocating what it holds inside on CUDA's route (`inside_peak`) for a
    moment before it returns: their fake functions allocate only what they return, and a memory tracker below
    this mode (over fake tensors: mixprec.plan_memory) then sees the operators' peaks."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mixprec" and func.overloadpacket.__name__ in EXPERTS_OPS:
            device = next(a.device for a in tree_leaves(args) if isinstance(a, torch.Tensor))
            torch.empty(inside_peak(func, args), dtype=torch.uint8, device=device)  # allocated, then freed
        return func(*args, **(kwargs or {}))
