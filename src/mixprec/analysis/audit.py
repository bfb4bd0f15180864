"""`mixprec audit`: one real training step under hooks, the dtype observed at every
stage against the dtype the precision policy promises.

What is observed, and how:
- parameters, gradients, optimizer states, master weights: read off the real objects
  (the local shard of a DTensor);
- compute: every aten op is seen by a TorchDispatchMode, which sorts them into classes
  (matmul operands and outputs in the forward, matmul outputs in the backward,
  the norm's rsqrt or layer_norm, softmax, log-softmax input, the loss) and the collectives FSDP2
  issues (all-gather and reduce-scatter buffers);
- accumulation: the gradients after the first micro-batch of two.
A stage the policy makes no promise about is reported, not judged.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections import defaultdict

import torch

from mixprec.analysis import audit_experts
from mixprec.analysis.audit_fp8 import NARROW, FP8Tracker, element_name, fp8_rows, promised_granularity
from mixprec.optim.updates import COMPENSATION
from mixprec.precision.dtypes import dtype_name
from mixprec.precision.emulation import _MATMULS, EmulatedMatmul
from mixprec.precision.spec import Update, format_name
from mixprec.shards import local_shard

aten = torch.ops.aten
FP32 = torch.float32
_BATCHED = {aten.bmm.default, aten.baddbmm.default}
_OPTIONAL = {"attention matmuls (bmm)"}  # absent where attention is one fused kernel


class _Observer(EmulatedMatmul):
    """Records the dtype of each op class; emulates low-precision matmuls when asked
    (as the policy would, so the recorded dtypes are the program's, not the emulation's)."""

    def __init__(self, emulate: bool, fp8: FP8Tracker | None = None):
        super().__init__()
        self.emulate, self.backward, self.fp8 = emulate, False, fp8
        self.seen: dict[str, set[torch.dtype]] = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.fp8 is not None and (out := audit_experts.decompose(self, self.fp8, func, args)) is not None:
            return out  # an experts operator, seen op by op
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in _MATMULS and self.emulate:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.fp8 is not None and self.fp8.observe(func, args, out, self.backward):
            return out  # an FP8 GEMM: its own stages, not the plain matmuls'
        if self.fp8 is not None and audit_experts.observe_grouped(self.fp8, func, args, out, self.backward, self.seen):
            return out
        if func in _BATCHED:  # attention's score and value products, forward and backward
            self.seen["attention matmuls (bmm)"].add(out.dtype)
            return out
        if func in _MATMULS:
            if self.backward:
                self.seen["local gradients (backward matmuls)"].add(out.dtype)
            else:
                self.seen["compute parameters (matmul operands)"] |= {t.dtype for t in tensors[-2:]}
                self.seen["matmul output"].add(out.dtype)
            return out
        if func is aten.rsqrt.default and not self.backward:  # RMSNorm, written out
            self.seen["norm"].add(out.dtype)
        elif func is aten.native_layer_norm.default and not self.backward:
            self.seen["norm"].add(out[0].dtype)
        elif func in (aten._softmax.default, aten._safe_softmax.default) and not self.backward:
            self.seen["softmax"].add(out.dtype)
        elif name.startswith("_scaled_dot_product") and not self.backward:
            self.seen["fused attention output (SDPA)"].add(out[0].dtype)
        elif func is aten._log_softmax.default and not self.backward:
            self.seen["logits (log-softmax input)"].add(args[0].dtype)
        elif func is aten.nll_loss_forward.default and not self.backward:
            self.seen["loss"].add(out[0].dtype)
        elif "all_gather" in name and tensors:
            self.seen["all-gather traffic"] |= {t.dtype for t in tensors}
        elif "reduce_scatter" in name and tensors:
            self.seen["reduce-scatter traffic"] |= {t.dtype for t in tensors}
        return out


def state_format_row(model, optimizer, moments) -> tuple[dict, list[str]]:
    """Each parameter's AdamW moments as stored (their codes' dtype, the block scales' shape, the
    block size recorded) against the spec's format: quantized, or FP32 where the format leaves
    the tensor out (small tensors, embeddings)."""
    from mixprec.optim.saved_state import saved_format
    from mixprec.optim.state_formats import SCALE, scale_shape
    from mixprec.precision.optimizer_states import embeddings_of

    embeddings = {id(p) for p in embeddings_of(model)}
    names = {id(p): n for n, p in model.named_parameters()}
    promised, observed, notes = {}, {}, []
    for p, state in optimizer.state.items():
        if "exp_avg" not in state:
            continue
        want = "fp32" if moments.keeps_fp32(p.numel(), id(p) in embeddings) else moments.label
        have = saved_format(state)
        if "exp_avg" + SCALE in state and tuple(state["exp_avg" + SCALE].shape) != scale_shape(
                p.shape, int(state.get("moments_block", 0)) or 1):
            have += f" with scales {tuple(state['exp_avg' + SCALE].shape)} for {tuple(p.shape)}"
        promised[want] = promised.get(want, 0) + 1
        observed[have] = observed.get(have, 0) + 1
        if have != want:
            notes.append(f"parameter {names.get(id(p), tuple(p.shape))}: moments promised in {want}, stored in {have}")
    count = lambda d: sorted(f"{k} x{v}" for k, v in d.items())
    return ({"stage": "optimizer state formats (per tensor)", "promised": count(promised), "observed": count(observed),
             "ok": not notes and bool(observed)}, notes[:10])


def promises(policy) -> dict[str, set[torch.dtype] | None]:
    """The dtypes the policy promises at each stage (after setup: `sharded` is known), read
    off its per-module layout where a module's compute may differ from the base mode's."""
    storage, compute = policy.storage_dtype, policy.param_dtype
    stored = {m.storage for m in policy.layout.modules.values()} if policy.layout is not None else {storage}
    computes = {compute} | set(policy.layout.dtype_overrides().values()) if policy.layout is not None else {compute}
    spec_moments = policy.spec.moments
    moments = {FP32 if policy.sharded and policy.master_weights else spec_moments.dtype}
    if spec_moments.quantized:  # 1-byte codes, FP32 block scales, FP32 moments of the tensors left out
        moments |= {FP32}
    if spec_moments.dtype == storage:  # moments kept as their parameters (torch.optim): routers' in FP32
        moments |= stored
    return {
        "stored parameters": stored,
        "compute parameters (matmul operands)": computes,
        "matmul output": computes,
        "norm": {FP32},
        "softmax": {FP32},
        "logits (log-softmax input)": {FP32},
        "loss": {FP32},
        "local gradients (backward matmuls)": computes,
        # torch's math attention (SDPA with a mask on a CPU) runs these in float32: wider, never narrower
        "attention matmuls (bmm)": computes | {FP32},
        # a gradient takes its parameter's dtype; under FSDP they stay inside fully_shard
        "accumulated gradients (micro-batch 1 of 2)": None if policy.sharded else stored,
        "reduced gradients": stored,
        "optimizer states": moments,
        "master weights": {FP32} if policy.master_weights else None,
        "Kahan compensation": {storage} if policy.spec.update is Update.KAHAN else None,
        # uint8: FSDP2 gathers a unit whose tensors differ in dtype (FP8 elements, FP32 scales) as bytes
        "all-gather traffic": ({compute, torch.uint8} if policy.layout is not None and policy.layout.fp8() else {compute})
        if policy.sharded else None,
        "reduce-scatter traffic": {policy.reduce_dtype} if policy.sharded else None,
    }


def run_audit(config) -> dict:
    """One optimizer step of two micro-batches of `config`, observed. Returns the report."""
    from mixprec.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        config = dataclasses.replace(
            config,
            job=dataclasses.replace(config.job, dump_folder=tmp),
            training=dataclasses.replace(config.training, steps=1, eval_interval=0, global_batch_size=-1),
            checkpoint=dataclasses.replace(config.checkpoint, enable=False),
            metrics=dataclasses.replace(config.metrics, progress_bar=False, plot=False, enable_tensorboard=False),
            # the observer sees aten ops as the eager program issues them; Inductor keeps
            # their dtypes but fuses them out of a dispatch mode's sight
            compile=dataclasses.replace(config.compile, enable=False))
        notes = ["audited eager: compile.enable is ignored here"] if config.compile.enable else []
        trainer = Trainer(config, accum=2)  # two micro-batches: accumulation is a stage of its own
        report = observe_step(trainer.raw_model, trainer.policy, trainer.optimizer,
                              lambda after_backward: trainer.train_step(before_step=after_backward),
                              micro_batches=trainer.accum, world_size=trainer.dims.world_size)
        report["notes"][:0] = notes
        return report


def audit(model: torch.nn.Module, policy, optimizer: torch.optim.Optimizer, batches, loss_fn=None,
          max_norm: float | None = 1.0) -> dict:
    """Observe one optimizer step of any model, set up by `policy.setup(model, optimizer)`,
    over `batches` (two or more micro-batches: accumulation is a stage of its own), and
    check every stage and every Linear against what the policy promised. `loss_fn(model,
    batch)` gives the loss (default: `model(*batch)` when a batch is a tuple, else
    `model(**batch).loss`, as a Hugging Face model returns it). Returns the report that
    `mixprec audit --json` prints; report["ok"] is the verdict.

        report = mixprec.audit(model, policy, optimizer, [batch0, batch1])
        assert report["ok"], mixprec.format_audit(report)
    """
    batches = list(batches)
    if len(batches) < 2:
        raise ValueError("mixprec.audit needs two or more micro-batches: gradient accumulation is a stage it checks")
    if loss_fn is None:
        def loss_fn(model, batch):
            return model(*batch) if isinstance(batch, (tuple, list)) else model(**batch).loss

    def step(after_backward) -> None:
        for micro, batch in enumerate(batches):
            with policy.autocast():
                loss = loss_fn(model, batch) / len(batches)
            policy.backward(loss)
            after_backward(micro)
        policy.step(optimizer, max_norm)

    return observe_step(model, policy, optimizer, step, micro_batches=len(batches))


def observe_step(model: torch.nn.Module, policy, optimizer: torch.optim.Optimizer, step, *, micro_batches: int,
                 world_size: int = 1) -> dict:
    """Run `step(after_backward)`, which takes one optimizer step and calls
    `after_backward(micro)` after each micro-batch's backward, under the observer; the
    report of every stage against the policy's promises."""
    notes = []
    tracker = FP8Tracker()  # which format each Linear's forward GEMMs ran in, FP8 or not
    observer = _Observer(emulate=policy.emulate_matmul, fp8=tracker)
    policy.emulation.active = False  # the observer emulates instead, after recording
    # Ops between the end of a forward and the start of the next are the backward's.
    hooks = [model.register_forward_pre_hook(lambda *_: setattr(observer, "backward", False)),
             model.register_forward_hook(lambda *_: setattr(observer, "backward", True))]
    hooks += tracker.hooks(model) + audit_experts.hooks(tracker, model)

    def grads() -> set[torch.dtype]:
        return {local_shard(p.grad).dtype for p in model.parameters() if p.grad is not None}

    def after_backward(micro: int) -> None:
        # the first micro-batch: accumulated locally; the last: reduced across ranks
        if micro == 0:
            observer.seen["accumulated gradients (micro-batch 1 of 2)"] |= grads()
        if micro == micro_batches - 1:
            observer.seen["reduced gradients"] |= grads()

    stored = {local_shard(p).dtype for p in model.parameters()}
    try:
        with observer:
            step(after_backward)
    finally:
        for h in hooks:
            h.remove()
        policy.emulation.active = observer.emulate
    tf32_during_step = policy.tf32_active
    seen = observer.seen
    seen["stored parameters"] = stored
    states = [(k, local_shard(t).dtype) for s in optimizer.state.values() for k, t in s.items()
              if torch.is_tensor(t) and k != "step"]
    seen["optimizer states"] = {dtype for k, dtype in states if k != COMPENSATION}
    seen["Kahan compensation"] = {dtype for k, dtype in states if k == COMPENSATION}
    if policy.masters is not None:
        seen["master weights"] = {m.dtype for m in policy.masters.named_masters(model).values()}
    elif policy.master_weights and policy.sharded:
        seen["master weights"] = stored  # the sharded parameters are the masters
    expected = promises(policy)
    if seen.get("fused attention output (SDPA)"):
        # the softmax runs inside the fused kernel (FP32 accumulators), out of the dispatcher's sight
        expected["softmax"] = None
        expected["fused attention output (SDPA)"] = {policy.param_dtype}
    rows = []
    for stage, promise in expected.items():
        observed = seen.get(stage, set())  # torch dtypes; named only for the report
        ok = promise is None or observed <= promise
        if promise is not None and not observed and stage not in _OPTIONAL and not stage.endswith("traffic"):
            ok = False  # a promised stage that never happened is a broken promise too
        rows.append({"stage": stage, "promised": sorted(map(dtype_name, promise)) if promise else None,
                     "observed": sorted(map(dtype_name, observed)), "ok": ok})
    if policy.param_dtype == FP32:
        # FP32 matmuls as TF32 or not: torch's process-wide setting during the step,
        # against precision.tf32 (which only acts on CUDA)
        promised = policy.tf32 and policy.device_type == "cuda"
        rows.append({"stage": "float32 matmuls", "promised": [_fp32_matmul_name(promised)],
                     "observed": [_fp32_matmul_name(tf32_during_step)], "ok": tf32_during_step == promised})
    module_rows, module_notes = per_module_rows(tracker, policy.layout, micro_batches)
    rows += module_rows
    notes += module_notes
    experts_rows, experts_notes = audit_experts.experts_rows(tracker, policy.layout, model, micro_batches)
    rows += experts_rows
    notes += experts_notes
    if policy.layout.fp8():
        fp8, fp8_notes = fp8_rows(tracker, policy, micro_batches=micro_batches)
        rows += fp8
        notes += fp8_notes
    if policy.spec.moments.quantized:
        state_row, state_notes = state_format_row(model, optimizer, policy.spec.moments)
        rows.append(state_row)
        notes += state_notes
    if policy.sharded and policy.layout.fp8():
        gather_row, gather_notes = all_gather_row(model, policy.param_dtype)
        rows.append(gather_row)
        notes += gather_notes
    path = ("fully_shard (FSDP2's MixedPrecisionPolicy)" if policy.sharded
            else "torch.autocast" if policy.uses_autocast else "none: parameters are already in the compute dtype")
    return {"precision": policy.name, "path": path, "world_size": world_size,
            "emulated_matmuls": observer.emulate, "stages": rows, "notes": notes,
            "ok": all(r["ok"] for r in rows)}


def per_module_rows(tracker: FP8Tracker, layout, micro_batches: int) -> tuple[list[dict], list[str]]:
    """Each Linear's GEMMs against its row of the layout: one row counting the layers per
    compute format in forward (an FP8 layer by its input's scale granularity), one for the
    FP8 layers' backward GEMMs; a note naming each layer that broke its promise."""
    promised, observed, notes, backward_ok = {}, {}, [], True
    for fqn, m in layout.linears().items():
        got = set(tracker.forward.get(fqn, set()))
        if isinstance(m.compute, torch.dtype):
            want = format_name(m.compute)
        else:
            rows = tracker.rows.get(fqn, 2)
            element = element_name(next(iter(m.compute.operand_formats[0])))
            want = f"{element} {promised_granularity(m.compute, rows, tracker.in_features.get(fqn, 0))}"
            scales = tracker.scaling.get(fqn, {"(scales not seen)"})
            got = (got - set(NARROW)) | {f"{kind} {g}" for kind in got & set(NARROW) for g in scales}
            gemms = tracker.backward_by_module.get(fqn, set())
            dtypes = {d for _, pair in gemms for d in pair}
            wanted = m.compute.operand_formats[1]
            if len(gemms) != 2 * micro_batches or dtypes != wanted:
                backward_ok = False
                notes.append(f"module {fqn}: promised {format_name(m.compute)} ({m.why}); its backward ran "
                             f"{len(gemms)} FP8 GEMMs on {', '.join(sorted(map(dtype_name, dtypes))) or 'nothing'}, "
                             f"not {2 * micro_batches} on {', '.join(sorted(map(dtype_name, wanted)))}")
        promised[want] = promised.get(want, 0) + 1
        for name in got:
            observed[name] = observed.get(name, 0) + 1
        if got and got != {want}:
            notes.append(f"module {fqn}: promised {want} ({m.why}), its forward GEMMs ran in "
                         f"{', '.join(sorted(got))}")
    count = lambda d: [f"{n} {k}" for k, n in sorted(d.items())]  # noqa: E731
    rows = [{"stage": "Linear layers by compute (per module)", "promised": count(promised),
             "observed": count(observed), "ok": not [n for n in notes if "forward GEMMs" in n]}]
    fp8_layers = [fqn for fqn, m in layout.linears().items() if not isinstance(m.compute, torch.dtype)]
    if fp8_layers:
        rows.append({"stage": "FP8 backward GEMMs (per module)",
                     "promised": [f"{2 * micro_batches} per layer"], "ok": backward_ok,
                     "observed": [f"{n} layers with {k}" for k, n in sorted(
                         _counts(len(tracker.backward_by_module.get(f, ())) for f in fp8_layers).items())]})
    return rows, notes


def all_gather_row(model: torch.nn.Module, param_dtype: torch.dtype) -> tuple[dict, list[str]]:
    """The dtype each low-precision Linear's weight was all-gathered in, read off FSDP2's own
    buffers, against its narrow format (or param_dtype where a reason was logged): a layer
    planned narrow that gathered wide fails, however it came to."""
    from mixprec.narrow.fsdp.linear import gathers

    promised, observed, notes, reasons, ok = {}, {}, [], {}, True
    for fqn, (got, want, why) in gathers(model, param_dtype).items():
        promised[dtype_name(want)] = promised.get(dtype_name(want), 0) + 1
        seen = dtype_name(got) if got is not None else "not gathered"
        observed[seen] = observed.get(seen, 0) + 1
        if why is not None:
            reasons.setdefault(why, []).append(fqn)
        if got != want:
            ok = False
            notes.append(f"module {fqn}: its weight was all-gathered in {seen}, not {dtype_name(want)}"
                         + ("" if why else " (its layer computes in a narrow format and no reason was logged)"))
    for why, fqns in reasons.items():
        notes.append(f"{len(fqns)} layer(s) all-gather in {dtype_name(param_dtype)} ({why}): {', '.join(fqns[:3])}"
                     + (", ..." if len(fqns) > 3 else ""))
    count = lambda d: [f"{n} {k}" for k, n in sorted(d.items())]  # noqa: E731
    return ({"stage": "weights all-gathered (per module, FSDP2's buffers)", "promised": count(promised),
             "observed": count(observed), "ok": ok}, notes)


def _counts(values) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _fp32_matmul_name(tf32: bool) -> str:
    return "tfloat32" if tf32 else "float32"


def format_audit(report: dict) -> str:
    lines = [f"precision {report['precision']}, {report['world_size']} process(es); mixed precision handled by "
             f"{report['path']}"]
    width = max(len(r["stage"]) for r in report["stages"])
    pw = max(18, *(len(", ".join(r["promised"] or [])) + 1 for r in report["stages"]))
    ow = max(28, *(len(", ".join(r["observed"])) + 1 for r in report["stages"]))
    lines.append(f"{'stage':<{width}}  {'promised':<{pw}} {'observed':<{ow}} ")
    for r in report["stages"]:
        promised = ", ".join(r["promised"]) if r["promised"] else "-"
        observed = ", ".join(r["observed"]) or "not observed"
        mark = "ok" if r["ok"] and r["promised"] else ("VIOLATION" if not r["ok"] else "")
        lines.append(f"{r['stage']:<{width}}  {promised:<{pw}} {observed:<{ow}} {mark}")
    lines += [f"note: {n}" for n in report["notes"]]
    lines.append("audit: " + ("every observed dtype keeps the policy's promise" if report["ok"]
                              else "an observed dtype breaks the policy's promise"))
    return "\n".join(lines)

