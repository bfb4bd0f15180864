"""The experts part of `mixprec audit`: what each experts module of a mixture-of-experts model
really ran its GEMMs in, per projection (gate_up_proj, down_proj) and pass.

A narrow experts projection is one operator per pass (mixprec::experts_mm and its backward),
whose insides a dispatch mode does not see: the observer runs it op by op under itself
(`decompose`), with the projection as the tracker's module, so each expert's casts and
scaled (or emulated) GEMMs are recorded as a Linear's are. An experts module in the base mode
runs torch's grouped GEMM (aten._grouped_mm), recorded with its operands' dtype. Routers are
judged with the plain matmuls, against the float32 their layout rows promise.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from mixprec.analysis.audit_fp8 import FP8Tracker, element_name
from mixprec.narrow.experts import ops as experts
from mixprec.narrow.experts.layer import tokens_per_expert
from mixprec.narrow.experts.hf import runs_here
from mixprec.precision.dtypes import dtype_name
from mixprec.precision.spec import format_name

EXPERTS_MM = torch.ops.mixprec.experts_mm.default
EXPERTS_MM_BACKWARD = torch.ops.mixprec.experts_mm_backward.default
GROUPED_MM = torch.ops.aten._grouped_mm.default
LOOP_MM = torch.ops.mixprec.experts_mm_loop.default  # the base mode outside bfloat16
LOOP_MM_BACKWARD = torch.ops.mixprec.experts_mm_loop_backward.default


def decompose(mode, tracker: FP8Tracker, func, args):
    """Run an experts operator op by op under `mode` (the audit's observer), recorded against its
    projection; None for any other operator."""
    if func not in (EXPERTS_MM, EXPERTS_MM_BACKWARD):
        return None
    x, weight, offs, *rest = args
    g = experts.gemm_of(rest[-1])  # named by its role: the layer is the module whose pass is running (`hooks`)
    name = f"{tracker.experts_module}.{g.name}"
    tracker.experts.add(name)
    tracker.in_features[name] = x.shape[1]
    before = tracker.module
    tracker._enter(name)
    try:
        with mode:
            if func is EXPERTS_MM:
                return experts.forward(x, weight, offs, g)
            tracker.expert_passes[name] += 1
            dy, salts, _ = rest
            return experts.backward(x, weight, offs, dy, g, salts)
    finally:
        tracker.module = before


def observe_grouped(tracker: FP8Tracker, func, args, out, backward: bool, seen: dict) -> bool:
    """torch's grouped GEMM or mixprec's expert-by-expert one (experts in the base mode): True when `func`
    was one."""
    if func not in (GROUPED_MM, LOOP_MM, LOOP_MM_BACKWARD):
        return False
    if backward or func is LOOP_MM_BACKWARD:
        seen["local gradients (backward matmuls)"] |= {t.dtype for t in (out if isinstance(out, tuple) else (out,))}
    elif tracker.module in tracker.experts:
        tracker.experts_forward[tracker.module] |= {dtype_name(args[0].dtype), dtype_name(args[1].dtype)}
    return True


def hooks(tracker: FP8Tracker, model: torch.nn.Module) -> list:
    """Hooks on every experts module that tell the tracker whose forward (or backward) is running, and
    count the rows each expert receives (its inputs: tokens, the router's top-k ids, their weights)."""
    def enter(module, args, fqn):
        tracker.module = tracker.experts_module = fqn
        tracker.expert_tokens[fqn] = tracker.expert_tokens.get(fqn, 0) + tokens_per_expert(args[1],
                                                                                                module.num_experts)

    handles = []
    for fqn, module in model.named_modules():
        if runs_here(module):
            tracker.experts.add(fqn)
            handles.append(module.register_forward_pre_hook(lambda m, a, fqn=fqn: enter(m, a, fqn)))
            handles.append(module.register_forward_hook(lambda m, a, out: setattr(tracker, "module", None)))
            handles.append(module.register_full_backward_pre_hook(
                lambda m, grad_out, fqn=fqn: setattr(tracker, "experts_module", fqn)))
    return handles


def tokens_note(fqn: str, counts: torch.Tensor | None) -> str:
    """What each expert of `fqn` received in the audited step (forward passes only: a block that
    recomputes its forward is counted once a pass)."""
    if counts is None:
        return f"experts {fqn}: not run in the audited step"
    c = counts.tolist()
    return (f"experts {fqn}: tokens per expert in the audited step {c} (max / mean {max(c) / max(sum(c) / len(c), 1e-9):.2f}"
            f"{f', {c.count(0)} experts received none' if 0 in c else ''})")


def experts_rows(tracker: FP8Tracker, layout, model: torch.nn.Module, micro_batches: int
                 ) -> tuple[list[dict], list[str]]:
    """One row counting the experts modules per compute format, one for their narrow backward
    GEMMs (two per expert with tokens per projection and micro-batch), and a note per module
    with the format of each of its GEMMs."""
    promised, observed, notes, ok, backward_ok = defaultdict(int), defaultdict(int), [], True, True
    for fqn, m in layout.modules.items():
        if m.kind != "experts":
            continue
        if not runs_here(model.get_submodule(fqn)):
            notes.append(f"experts {fqn}: left in {m.compute_name}, not judged here ({m.why})")
            continue
        notes.append(tokens_note(fqn, tracker.expert_tokens.get(fqn)))
        if isinstance(m.compute, torch.dtype):
            want, got = format_name(m.compute), tracker.experts_forward.get(fqn, set())
            notes.append(f"experts {fqn}: grouped GEMMs on {', '.join(sorted(got)) or 'nothing'} ({m.why})")
        else:
            want = element_name(next(iter(m.compute.operand_formats[0])))
            projections = sorted(n for n in tracker.experts if n.startswith(f"{fqn}."))
            got, said = set(tracker.experts_forward.get(fqn, set())), []  # GEMMs it ran outside the recipe's operator
            for name in projections:
                forward = tracker.experts_forward.get(name, set())
                gemms = tracker.experts_backward.get(name, set())
                dtypes = {d for _, pair in gemms for d in pair}
                passes = tracker.expert_passes.get(name, 0)
                got |= forward
                if len(gemms) < 2 * passes or dtypes != m.compute.operand_formats[1] or not passes:
                    backward_ok = False
                said.append(f"{name.rpartition('.')[2]}: forward {', '.join(sorted(forward)) or 'not seen'}, backward "
                            f"{len(gemms)} GEMMs on {', '.join(sorted(map(dtype_name, dtypes))) or 'nothing'} "
                            f"({passes} backward passes, an input- and a weight-gradient grouped GEMM each at least)")
            notes.append(f"experts {fqn} ({format_name(m.compute)}, each expert scaled on its own): " + "; ".join(said))
            if not projections:
                backward_ok = False
        promised[want] += 1
        label = ", ".join(sorted(got)) or "not seen"
        observed[label] += 1
        ok &= got == {want}
    if not promised:
        return [], notes
    count = lambda d: [f"{n} {k}" for k, n in sorted(d.items())]  # noqa: E731
    rows = [{"stage": "experts modules by compute (per module)", "promised": count(promised),
             "observed": count(observed), "ok": ok}]
    if layout.experts():
        rows.append({"stage": "narrow experts backward GEMMs", "promised": ["input and weight gradient per pass"],
                     "observed": ["as promised" if backward_ok else "see the notes"], "ok": backward_ok})
    return rows, notes
