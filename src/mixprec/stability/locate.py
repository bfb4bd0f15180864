"""The locator: re-run a failing micro-batch under an observer that names the first
module, op and dtype producing a non-finite value, in the forward pass, else in the
backward pass.

Forward: a TorchDispatchMode checks every op's outputs while module hooks keep the
stack of modules being run; the first op with a non-finite output is named with the
innermost module around it. Backward: each module's full backward hook compares the
gradient arriving at its output with the gradients it passes on (and parameter hooks
look at its weight gradients); the first module that turns finite gradients into
non-finite ones is named, with the first backward op that did. Every op syncs with
the host here, which is why this runs only on an incident, never on a healthy step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mixprec.dtypes import dtype_name
from mixprec.shards import local_shard


@dataclass
class Finding:
    module: str  # the module's name in the model (layers.3.feed_forward.w2)
    phase: str  # forward or backward
    op: str  # the aten op (mm, _scaled_mm, masked_fill, ...); "" where no op was seen
    dtype: str  # what the non-finite tensor is in
    dtype_max: float  # that dtype's largest finite value (torch.finfo)
    max_abs_input: float  # the largest |value| among its inputs (all finite: that is what makes it the first)
    rank: int = 0

    def __str__(self) -> str:
        what = "output" if self.phase == "forward" else "gradient"
        op = f"{self.op}, " if self.op else ""
        rank = f" on rank {self.rank}" if self.rank else ""
        return f"{self.module} ({self.phase}, {op}{self.dtype} {what}, inputs finite, max |input| " \
               f"{self.max_abs_input:.3g}){rank}"

    def to_dict(self) -> dict:
        return {**asdict(self), "max_abs_input": _json_float(self.max_abs_input)}


def _json_float(x: float):
    return x if math.isfinite(x) else None


def _floats(tree) -> list[torch.Tensor]:
    # FP8 tensors widened: torch has no isfinite for them. Packed FP4 (two e2m1 codes a byte)
    # has no cast at all, and no code for an infinity or a NaN: never a non-finite value.
    return [t.detach().float() if t.element_size() == 1 else t.detach()
            for t in map(local_shard, (t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)))
            if t.is_floating_point() and t.numel() and t.dtype is not torch.float4_e2m1fn_x2]


def _dtype(t: torch.Tensor) -> tuple[str, float]:
    """A finding's dtype: its name, and its largest finite value."""
    return dtype_name(t.dtype), torch.finfo(t.dtype).max


def _finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _max_abs(tensors: list[torch.Tensor]) -> float:
    finite = [t[torch.isfinite(t)] for t in tensors]
    return max((float(t.abs().max()) for t in finite if t.numel()), default=0.0)


def _intended(args, kwargs) -> bool:
    """An op told to write an infinity (a causal mask's masked_fill(mask, -inf)) means it."""
    return any(isinstance(a, float) and math.isinf(a) for a in tree_leaves((args, kwargs)))


class _OpWatch(TorchDispatchMode):
    """Records each op that turns finite floating inputs into a non-finite output, with the
    stack of modules around it."""

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack, self.ops = stack, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = _floats(out)
        if outs and not _finite(outs) and not _intended(args, kwargs):
            ins = _floats((args, kwargs))
            if _finite(ins):
                self.ops.append((tuple(self.stack), func.overloadpacket.__name__, _max_abs(ins)))
        return out

    def op_in(self, module: str, start: int = 0):
        """The first recorded op (from `start`) that ran inside `module`'s call."""
        return next((op for op in self.ops[start:] if module in op[0]), None)


class Locator:
    """`Locator(model).run(forward, backward)` runs `loss = forward()` and `backward(loss)`
    (one micro-batch) under the observer and returns a Finding, or None when everything
    stayed finite. Forward: the first module whose output is non-finite while its inputs
    were finite. Backward: the first module whose outgoing gradients are non-finite while
    the gradient arriving at its output was finite, or whose weight gradient is."""

    def __init__(self, model: torch.nn.Module, rank: int = 0):
        self.model, self.rank = model, rank
        self.names = {m: name or type(model).__name__ for name, m in model.named_modules()}

    def run(self, forward, backward) -> Finding | None:
        stack: list[str] = []
        inputs: list[list[torch.Tensor]] = []
        found: list[Finding] = []

        def push(module, args, kwargs):
            stack.append(self.names[module])
            inputs.append(_floats((args, kwargs)))

        def pop(module, args, kwargs, output):
            name, ins = stack.pop() if stack else "", inputs.pop() if inputs else []
            outs = _floats(output)
            if not found and outs and not _finite(outs) and _finite(ins):
                found.append(Finding(name, "forward", "", *_dtype(outs[0]), _max_abs(ins), self.rank))

        def grads(module, grad_input, grad_output):
            incoming, outgoing = _floats(grad_output), _floats(grad_input)
            if not found and outgoing and not _finite(outgoing) and _finite(incoming):
                found.append(Finding(self.names[module], "backward", "", *_dtype(outgoing[0]), _max_abs(incoming),
                                     self.rank))

        def param_hook(name):
            def hook(grad):
                if not found and grad.is_floating_point() and not _finite(_floats(grad)):
                    found.append(Finding(name, "backward", "", *_dtype(grad), 0.0, self.rank))
            return hook

        handles = []
        for module, name in self.names.items():
            handles += [module.register_forward_pre_hook(push, with_kwargs=True),
                        module.register_forward_hook(pop, with_kwargs=True, always_call=True),
                        module.register_full_backward_hook(grads)]
            handles += [p.register_hook(param_hook(name)) for p in module.parameters(recurse=False) if p.requires_grad]
        watch = _OpWatch(stack)
        backward_from = None
        try:
            # a module whose inputs need no gradient (the embedding) has its hook fire on its output's gradient
            with _eager(), watch, warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Full backward hook is firing")
                warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view")  # the observer's outputs
                loss = forward()
                backward_from = len(watch.ops)
                backward(loss)  # also after a forward finding: other ranks' backward collectives wait for it
        finally:
            for h in handles:
                h.remove()
        if not found:
            return None
        finding = found[0]
        if finding.phase == "forward":
            op = watch.op_in(finding.module)
        else:  # backward ops run outside any module's forward call: the first one after the forward
            op = watch.ops[backward_from] if backward_from < len(watch.ops) else None
        if op is not None:
            finding.op = op[1]
            finding.max_abs_input = max(finding.max_abs_input, op[2])
        return finding


@contextlib.contextmanager
def _eager():
    """Compiled regions would hide their ops from the observer: run them eagerly."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    with set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
        yield


def agree(found: Finding | None, world_size: int) -> Finding | None:
    """The finding every rank acts on, where each located on its own batch (a promotion on one
    rank only would leave the ranks computing differently): all gathered, the first one in the
    forward pass, then the lowest rank's. One process: its own."""
    if world_size <= 1:
        return found
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, found.to_dict() if found else None)
    ranked = sorted((f for f in everyone if f), key=lambda f: (f["phase"] != "forward", f["rank"]))
    found = Finding(**ranked[0]) if ranked else None
    if found is not None and found.max_abs_input is None:
        found.max_abs_input = math.nan
    return found
