"""The FP8 part of `mixprec audit`: which Linear layers really ran their GEMMs in FP8.

An FP8 GEMM is seen at the dispatcher as torch's scaled GEMM on FP8 operands, or, where
it is emulated, as an FP32 matmul whose two operands are FP8 tensors widened to FP32
(followed through slices and transposes). Forward GEMMs are attributed to the Linear
whose forward is running, with the granularity of its input's scales (the shape of the
first per-tile amax its cast takes: one for the tensor, one per row, or one per
1x128 tile); backward ones to the Linear whose backward began last (a full backward
pre-hook), two per FP8 layer and micro-batch (the input gradient and the weight
gradient), an emulated GEMM once however many 128-wide partial products it issues.
"""

from __future__ import annotations

import itertools
import weakref
from collections import defaultdict

import torch

import mixprec.narrow  # noqa: F401 - registers the microscaled recipes' operators
from mixprec.narrow.formats.microscaling import E2M1
from mixprec.precision.dtypes import dtype_name
from mixprec.precision.emulation import _MATMULS

aten = torch.ops.aten
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MX_MM = torch.ops.mixprec.mx_mm.default  # registered by mixprec.narrow.gemm.mx
MX_QUANTIZE = torch.ops.mixprec.mx_quantize.default
GROUPED_MM = torch.ops.mixprec.grouped_mm.default  # registered by mixprec.narrow.experts.fp8: grouped experts
GROUPED_BLOCKWISE = (torch.ops.mixprec.grouped_blockwise_mm.default,  # mixprec.narrow.experts.blockwise
                     torch.ops.mixprec.grouped_blockwise_wgrad.default)
BLOCKWISE_MM = torch.ops.mixprec.blockwise_scaled_mm.default  # registered by mixprec.narrow.gemm.fp8
NARROW = ("float8", "e2m1")  # how the report names a GEMM's element format
_VIEWS = {aten.slice.Tensor, aten.t.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default,
          aten.expand.default, aten.alias.default, aten.permute.default, aten.narrow.default, aten.reshape.default}
# An experts operator run op by op inside the observer (mixprec.analysis.audit_experts) issues its ops below
# autograd, where composite ops arrive undecomposed: a widening as aten.to, a GEMM as aten.matmul
_WIDENINGS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout}
_GEMMS = _MATMULS | {aten.matmul.default}


def element_name(dtype: torch.dtype) -> str:
    """A narrow GEMM's element format as the report names it: float8 (e4m3, e5m2) or e2m1 (FP4)."""
    return "e2m1" if dtype == E2M1 else "float8"


def granularity(tr: int, tc: int, rows: int, cols: int) -> str:
    """How a (rows, cols) input cast in (tr, tc) tiles is scaled, by name. A 1x128 tile of
    a 128-wide input is a row: that cast is row-wise, whatever recipe asked for it."""
    if tr >= rows and tc >= cols:
        return "tensorwise"
    return "rowwise" if tr == 1 and tc >= cols else f"{tr}x{tc} tiles"


def promised_granularity(recipe, rows: int, cols: int) -> str:
    tr, tc = recipe.tiles.x
    return granularity(tr or rows, tc or cols, rows, cols)


class FP8Tracker:
    def __init__(self):
        # FP32 tensor -> (itself, its FP8 source dtype, the serial number of the widening it comes from)
        self._widened: dict[int, tuple[weakref.ref, torch.dtype, int]] = {}
        self._serials = itertools.count()
        self._backward_pairs: set[tuple] = set()
        self.module: str | None = None  # the Linear whose forward (or, in backward, whose backward) is running
        self.forward: dict[str, set[str]] = defaultdict(set)  # Linear -> "float8", "e2m1" or a plain GEMM's dtype
        self.scaling: dict[str, set[str]] = defaultdict(set)  # Linear -> its input cast's granularity
        self.backward_by_module: dict[str, set[tuple]] = defaultdict(set)  # Linear -> its backward FP8 GEMMs
        self._cast_seen: set[str] = set()
        self.in_features: dict[str, int] = {}
        self.rows: dict[str, int] = {}  # the rows (tokens) of each Linear's last FP8 input cast
        self.operands = {"forward": set(), "backward": set()}
        self.outputs: set[torch.dtype] = set()
        # experts projections and modules (mixprec.analysis.audit_experts): recorded apart from the Linear layers
        self.experts: set[str] = set()
        self.experts_module: str | None = None  # the experts module whose forward (or backward) ran last
        self.experts_forward: dict[str, set[str]] = defaultdict(set)
        self.experts_backward: dict[str, set[tuple]] = defaultdict(set)
        self.expert_passes: dict[str, int] = defaultdict(int)  # backward passes of each experts projection
        self.expert_tokens: dict[str, torch.Tensor] = {}  # experts module -> rows each expert received in forward

    @property
    def backward_gemms(self) -> int:
        return len(self._backward_pairs)

    def _source(self, t) -> tuple[torch.dtype, int] | None:
        if not isinstance(t, torch.Tensor):
            return None
        if t.dtype in FP8_DTYPES:
            return t.dtype, next(self._serials)
        entry = self._widened.get(id(t))
        return entry[1:] if entry is not None and entry[0]() is t else None

    def _track(self, out, source) -> None:
        self._widened[id(out)] = (weakref.ref(out), *source)

    def observe(self, func, args, out, backward: bool) -> bool:
        """Record `func`; True when it was an FP8 GEMM (the caller keeps it out of the plain matmul stages)."""
        first = args[0] if args else None
        casting = not backward and self.module is not None and self.module not in self._cast_seen
        if casting and func is aten.amax.default and first.dim() == 4:
            # the input's cast comes first in an FP8 Linear's forward: its amax runs over a
            # (rows / tr, tr, cols / tc, tc) view of the input, one max per (tr, tc) tile
            rows, (tr, tc) = first.shape[0] * first.shape[1], (first.shape[1], first.shape[3])
            self._cast(rows, tr, tc)
        elif casting and func is MX_QUANTIZE:
            # a microscaled Linear's first cast is its input's, one operator: its blocks are
            # read off what it returned, the elements (rows padded, columns packed two a byte
            # for e2m1) against one scale per block
            data, scale = out[0], out[1]
            rows, cols = data.shape[0], data.shape[1] * (2 if data.dtype == E2M1 else 1)
            self._cast(first.shape[0], rows // scale.shape[0], cols // scale.shape[1])
        if func in _WIDENINGS and isinstance(first, torch.Tensor) and first.dtype in FP8_DTYPES:
            self._track(out, (first.dtype, next(self._serials)))  # an FP8 tensor widened for the emulated GEMM
        elif func in _VIEWS and (src := self._source(first)) is not None and out.dtype not in FP8_DTYPES:
            self._track(out, src)
        if func is MX_MM:  # a microscaled GEMM: one operator on the two operands' elements
            sources = [(args[0].dtype, next(self._serials)), (args[5].dtype, next(self._serials))]
            return self._record(sources, backward)
        if func is GROUPED_MM:  # a grouped experts GEMM: the operands' elements ride along
            return self._record([(args[3].dtype, next(self._serials)), (args[4].dtype, next(self._serials))],
                                backward)
        if func in GROUPED_BLOCKWISE:  # the block-wise experts' kernels: (a, scales, b, scales, ...)
            return self._record([(args[0].dtype, next(self._serials)), (args[2].dtype, next(self._serials))],
                                backward)
        # torch's scaled GEMMs, and mixprec's block-wise one: an operator whose insides (F.scaled_mm) a dispatch
        # mode does not see, so it is recognised by itself (on CUDA the audit missed every block-wise kernel GEMM)
        scaled = getattr(func, "__name__", "").startswith("_scaled_mm") or func is BLOCKWISE_MM
        sources = [self._source(a) for a in args[:2]] if (scaled or func in _GEMMS) else []
        if func in (aten.addmm.default, aten.baddbmm.default):
            sources = [self._source(a) for a in args[1:3]]
        if not sources or None in sources:
            if func in _MATMULS and not backward and self.module is not None:
                self.forward[self.module].add(dtype_name(first.dtype))
            return False
        return self._record(sources, backward)

    def _cast(self, rows: int, tr: int, tc: int) -> None:
        self._cast_seen.add(self.module)
        self.rows[self.module] = rows
        self.scaling[self.module].add(granularity(tr, tc, rows, self.in_features[self.module]))

    def _record(self, sources, backward: bool) -> bool:
        self.operands["backward" if backward else "forward"].update(dtype for dtype, _ in sources)
        if self.module in self.experts:
            pair = tuple(serial for _, serial in sources), tuple(dtype for dtype, _ in sources)
            if backward:
                self.experts_backward[self.module].add(pair)
            else:
                self.experts_forward[self.module].add(element_name(sources[0][0]))
            return True
        if backward:
            pair = tuple(serial for _, serial in sources)
            self._backward_pairs.add(pair)
            if self.module is not None:
                self.backward_by_module[self.module].add((pair, tuple(dtype for dtype, _ in sources)))
        elif self.module is not None:
            self.forward[self.module].add(element_name(sources[0][0]))
        return True

    def _enter(self, name: str) -> None:
        self.module = name
        self._cast_seen.discard(name)

    def hooks(self, model: torch.nn.Module) -> list:
        """Forward hooks on every Linear that tell the tracker whose forward is running."""
        from mixprec.narrow.linear.fp8 import FP8Linear

        handles = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                self.in_features[name] = module.in_features
                handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self._enter(name)))
                handles.append(module.register_full_backward_pre_hook(
                    lambda m, g, name=name: setattr(self, "module", name)))
                handles.append(module.register_full_backward_hook(lambda m, gi, go: setattr(self, "module", None)))

                def done(m, a, out):
                    if isinstance(m, FP8Linear):
                        self.outputs.add(out.dtype)
                    self.module = None

                handles.append(module.register_forward_hook(done))
        return handles


def fp8_rows(tracker: FP8Tracker, policy, micro_batches: int) -> tuple[list[dict], list[str]]:
    """The audit's FP8 rows and notes for a policy with an FP8 recipe."""
    conversion, layout = policy.fp8_conversion, policy.layout
    recipe = conversion.recipe
    planned = set(layout.fp8())
    in_fp8 = {name for name, kinds in tracker.forward.items() if kinds & set(NARROW)}
    mixed = {name for name in in_fp8 if len(tracker.forward[name]) != 1}
    notes = [f"fp8: {c.describe()}" for c in policy.formats.conversions]
    for name in sorted(planned - in_fp8):
        notes.append(f"fp8: {name} was planned for FP8 but its forward GEMM ran in "
                     f"{', '.join(sorted(tracker.forward.get(name, {'nothing'})))}")
    for name in sorted(in_fp8 - planned):
        notes.append(f"fp8: {name} ran in FP8 but the plan leaves it out")
    for name in sorted(mixed):
        notes.append(f"fp8: {name} ran some forward GEMMs outside FP8")
    for name, reason in layout.left_out().items():
        notes.append(f"fp8: {name} left in {layout.modules[name].compute_name}: {reason}")
    if recipe.delayed and conversion.modules:
        name, m = next(iter(conversion.modules.items()))
        for role, i in (("input", 0), ("weight", 1), ("output gradient", 2)):
            notes.append(f"fp8: {name} {role}: amax history (newest first) "
                         f"[{', '.join(f'{v:.4g}' for v in m.amax_history[i, :4].tolist())}, ...], scale {m.scale[i].item():.4g}")
    else:
        notes.append(f"fp8: scales are computed from each tensor's own amax at every cast ({recipe.summary()})")
    expected_backward = 2 * micro_batches * len(planned)
    forward_formats = {d for r in layout.recipes() for d in r.operand_formats[0]}
    grad_formats = {d for r in layout.recipes() for d in r.operand_formats[1]}
    rows = [
        {"stage": "narrow layers (forward GEMMs in float8 or e2m1)", "promised": [f"{len(planned)} planned"],
         "observed": [f"{len(in_fp8)} ran"], "ok": in_fp8 == planned and not mixed},
        {"stage": "FP8 forward operands", "promised": sorted(map(dtype_name, forward_formats)),
         "observed": sorted(map(dtype_name, tracker.operands["forward"])),
         "ok": tracker.operands["forward"] == forward_formats},
        {"stage": "FP8 backward operands", "promised": sorted(map(dtype_name, grad_formats)),
         "observed": sorted(map(dtype_name, tracker.operands["backward"])),
         "ok": tracker.operands["backward"] == grad_formats},
        {"stage": "FP8 backward GEMMs", "promised": [str(expected_backward)], "observed": [str(tracker.backward_gemms)],
         "ok": tracker.backward_gemms == expected_backward},
        {"stage": "FP8 layer outputs", "promised": [dtype_name(policy.param_dtype)],
         "observed": sorted(map(dtype_name, tracker.outputs)), "ok": tracker.outputs == {policy.param_dtype}},
    ]
    return rows, notes
