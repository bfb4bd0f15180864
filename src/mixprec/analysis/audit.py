"""`mixprec audit`: one real training step under hooks, the dtype observed at every
stage against the dtype the precision policy promises.

What is observed, and how:
- parameters, gradients, optimizer states, master weights: read off the real objects
  (the local shard of a DTensor);
- compute: every aten op is seen by a TorchDispatchMode, which sorts them into classes
  (matmul operands and outputs in the forward, matmul outputs in the backward,
  the norm's rsqrt, softmax, log-softmax input, the loss) and the collectives FSDP2
  issues (all-gather and reduce-scatter buffers);
- accumulation: the gradients after the first micro-batch of two.
A stage the policy makes no promise about is reported, not judged.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections import defaultdict

import torch

from mixprec.analysis.audit_fp8 import FP8Tracker, fp8_rows
from mixprec.optim.updates import COMPENSATION
from mixprec.precision.dtypes import dtype_name
from mixprec.precision.emulation import _MATMULS, EmulatedMatmul

aten = torch.ops.aten
FP32 = torch.float32


class _Observer(EmulatedMatmul):
    """Records the dtype of each op class; emulates low-precision matmuls when asked
    (as the policy would, so the recorded dtypes are the program's, not the emulation's)."""

    def __init__(self, emulate: bool, fp8: FP8Tracker | None = None):
        super().__init__()
        self.emulate, self.backward, self.fp8 = emulate, False, fp8
        self.seen: dict[str, set[torch.dtype]] = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in _MATMULS and self.emulate:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.fp8 is not None and self.fp8.observe(func, args, out, self.backward):
            return out  # an FP8 GEMM: its own stages, not the plain matmuls'
        if func in _MATMULS:
            if self.backward:
                self.seen["local gradients (backward matmuls)"].add(out.dtype)
            else:
                self.seen["compute parameters (matmul operands)"] |= {t.dtype for t in tensors[-2:]}
                self.seen["matmul output"].add(out.dtype)
            return out
        if func is aten.rsqrt.default and not self.backward:
            self.seen["norm (rsqrt)"].add(out.dtype)
        elif func is aten._softmax.default and not self.backward:
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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def promises(policy) -> dict[str, set[torch.dtype] | None]:
    """The dtypes the policy promises at each stage (after setup: `sharded` is known)."""
    storage, compute = policy.storage_dtype, policy.param_dtype
    stored = {storage, FP32} if policy.master_weights and not policy.sharded else {storage}
    return {
        "stored parameters": stored,
        "compute parameters (matmul operands)": {compute},
        "matmul output": {compute},
        "norm (rsqrt)": {FP32},
        "softmax": {FP32},
        "logits (log-softmax input)": {FP32},
        "loss": {FP32},
        "local gradients (backward matmuls)": {compute},
        # a gradient takes its parameter's dtype; under FSDP they stay inside fully_shard
        "accumulated gradients (micro-batch 1 of 2)": None if policy.sharded else stored,
        "reduced gradients": stored,
        "optimizer states": {policy.optimizer_moments_dtype} if policy.optimizer_moments_dtype != FP32
        else {FP32} if policy.master_weights else {storage},
        "master weights": {FP32} if policy.master_weights else None,
        "Kahan compensation": {storage} if policy.update == "kahan" else None,
        "all-gather traffic": {compute} if policy.sharded else None,
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
        trainer = Trainer(config)
        trainer.accum = 2  # two micro-batches: accumulation is a stage of its own
        policy, model = trainer.policy, trainer.raw_model
        tracker = FP8Tracker() if policy.fp8 is not None else None
        observer = _Observer(emulate=policy.emulate_matmul, fp8=tracker)
        policy.emulate_matmul = False  # the observer emulates instead, after recording
        # Ops between the end of a forward and the start of the next are the backward's.
        hooks = [model.register_forward_pre_hook(lambda *_: setattr(observer, "backward", False)),
                 model.register_forward_hook(lambda *_: setattr(observer, "backward", True))]
        hooks += tracker.hooks(model) if tracker is not None else []

        def grads() -> set[torch.dtype]:
            return {_local(p.grad).dtype for p in model.parameters() if p.grad is not None}

        def after_backward(micro: int) -> None:
            # micro-batch 0: accumulated locally; micro-batch 1: reduced across ranks
            observer.seen["accumulated gradients (micro-batch 1 of 2)" if micro == 0 else "reduced gradients"] |= grads()

        stored = {_local(p).dtype for p in model.parameters()}
        with observer:
            trainer.train_step(before_step=after_backward)
        tf32_during_step = policy.tf32_active
        for h in hooks:
            h.remove()
        policy.emulate_matmul = observer.emulate
        seen = observer.seen
        seen["stored parameters"] = stored
        states = [(k, _local(t).dtype) for s in trainer.optimizer.state.values() for k, t in s.items()
                  if torch.is_tensor(t) and k != "step"]
        seen["optimizer states"] = {dtype for k, dtype in states if k != COMPENSATION}
        seen["Kahan compensation"] = {dtype for k, dtype in states if k == COMPENSATION}
        if policy._master is not None:
            seen["master weights"] = {m.dtype for m in policy._master.named_masters(model).values()}
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
            if promise is not None and not observed and not stage.endswith("traffic"):
                ok = False  # a promised stage that never happened is a broken promise too
            rows.append({"stage": stage, "promised": sorted(map(dtype_name, promise)) if promise else None,
                         "observed": sorted(map(dtype_name, observed)), "ok": ok})
        if policy.param_dtype == FP32:
            # FP32 matmuls as TF32 or not: torch's process-wide setting during the step,
            # against precision.tf32 (which only acts on CUDA)
            promised = policy.tf32 and policy.device_type == "cuda"
            rows.append({"stage": "float32 matmuls", "promised": [_fp32_matmul_name(promised)],
                         "observed": [_fp32_matmul_name(tf32_during_step)], "ok": tf32_during_step == promised})
        if tracker is not None:
            fp8, fp8_notes = fp8_rows(tracker, policy, micro_batches=trainer.accum)
            rows += fp8
            notes += fp8_notes
        path = ("fully_shard (FSDP2's MixedPrecisionPolicy)" if policy.sharded
                else "torch.autocast" if policy.uses_autocast else "none: parameters are already in the compute dtype")
        return {"precision": policy.name, "path": path, "world_size": trainer.dims.world_size,
                "emulated_matmuls": observer.emulate, "stages": rows, "notes": notes,
                "ok": all(r["ok"] for r in rows)}


def _fp32_matmul_name(tf32: bool) -> str:
    return "tfloat32" if tf32 else "float32"


def format_report(report: dict) -> str:
    lines = [f"precision {report['precision']}, {report['world_size']} process(es); mixed precision handled by "
             f"{report['path']}"]
    width = max(len(r["stage"]) for r in report["stages"])
    lines.append(f"{'stage':<{width}}  {'promised':<18} {'observed':<28} ")
    for r in report["stages"]:
        promised = ", ".join(r["promised"]) if r["promised"] else "-"
        observed = ", ".join(r["observed"]) or "not observed"
        mark = "ok" if r["ok"] and r["promised"] else ("VIOLATION" if not r["ok"] else "")
        lines.append(f"{r['stage']:<{width}}  {promised:<18} {observed:<28} {mark}")
    lines += [f"note: {n}" for n in report["notes"]]
    lines.append("audit: " + ("every observed dtype keeps the policy's promise" if report["ok"]
                              else "an observed dtype breaks the policy's promise"))
    return "\n".join(lines)

