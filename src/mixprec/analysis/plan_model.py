"""The memory of one training step of any model, planned by running that step on fake tensors.

    plan = mixprec.plan_memory(lambda: MyModel(config), "bf16-mixed", batch)
    plan["peak_bytes"], plan["by_kind"]        # parameters, gradients, optimizer, activations, ...

The model is built under PyTorch's FakeTensorMode (shapes, dtypes and devices, no data and
no memory), set up by the policy and trained for two steps; PyTorch's MemTracker follows the
second one. Every tensor the real step would allocate is allocated here, with its real
dtype, so the peak is the step's own, up to the allocator's rounding (on a tiny Hugging Face
Llama the fake peak equalled the real step's byte for byte). Nothing of the model needs to
fit in memory, which is the point. What it does not model: the loss scaler (one number), the
gradient clipping's norm (one number per tensor group), the matmul emulation of CPUs
without BF16 hardware (a CPU artifact; planned is the program a GPU runs), and sharding
(FSDP2 and tensor parallel need process groups; `mixprec memory` plans them for
mixprec's own model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.utils._pytree

from mixprec.errors import UserError


def _loss(model, batch):
    return model(*batch) if isinstance(batch, (tuple, list)) else model(**batch).loss


def plan_memory(build_model, policy, batch, *, optimizer=None, loss_fn=None) -> dict:
    """Plan one training step of the model `build_model()` returns under `policy` (a Policy
    or a preset name) on `batch` (a tuple for `model(*batch)`, or a dict for a Hugging Face
    `model(**batch).loss`; real tensors, only their shapes are used). optimizer(params):
    the optimizer (default AdamW, with the policy's moments dtype). loss_fn(model, batch):
    the loss (default as mixprec.audit). Returns bytes per kind and the peak."""
    from mixprec.optim import AdamW
    from mixprec.precision import Policy

    if isinstance(policy, str):
        policy = Policy.from_preset(policy)
    elif policy.model is not None:
        raise UserError("plan_memory needs a policy that has not been set up yet (or a preset name): it sets one "
                        "up on the fake model")
    moments = policy.optimizer_moments_dtype
    optimizer = optimizer or (lambda params: AdamW(params, moments_dtype=moments) if moments != torch.float32
                              else torch.optim.AdamW(params, fused=True))
    with _quiet():  # the fake model's setup lines (paths, conversions) are not this run's
        # no loss scaler: its scale is one number read on the host, which a fake tensor has not
        planned = Policy(dataclasses.replace(policy.spec, loss_scaling=False), emulate_matmul=False,
                         tf32=policy.tf32, fp8_exclude=policy.fp8_exclude, fp8_emulate=policy.fp8_emulate)
        return _plan(build_model, planned, policy.name, batch, optimizer, loss_fn or _loss)


@contextlib.contextmanager
def _quiet():
    log = logging.getLogger("mixprec")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _plan(build_model, planned, name: str, batch, optimizer, loss_fn) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from mixprec.fp8.gemm import probe
    from mixprec.fp8.recipe import FP8Recipe

    for recipe in {f for f in planned.spec.compute_formats if isinstance(f, FP8Recipe)}:
        for _, (a_tile, b_tile), dtypes in recipe.gemms(planned.param_dtype):
            probe("cpu", a_tile, b_tile, *dtypes)  # on real tensors now; cached for the fake model's conversion
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        model = build_model()
        opt = optimizer(model.parameters())
        model, opt = planned.setup(model, opt)
        fake = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, batch)

        def step() -> None:
            # Policy.step's memory without its host sync (a fake tensor has no value): the
            # masters' FP32 gradients, the update, the masters copied back
            with planned.autocast():
                loss = loss_fn(model, fake)
            planned.backward(loss)
            if planned.masters is not None:
                planned.masters.grads_to_master()
            (planned.updates or opt).step()
            if planned.masters is not None:
                planned.masters.master_to_model()
            opt.zero_grad(set_to_none=True)

        step()  # the first step allocates the optimizer's states: the second is the steady one
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")
    (device, kinds), = peak.items()
    by_kind = {str(k).rsplit(".", 1)[-1].lower(): int(v) for k, v in kinds.items() if k != "Total" and v}
    return {"precision": name, "device": str(device), "peak_bytes": int(kinds["Total"]),
            "by_kind": by_kind, "parameters": sum(p.numel() for p in model.parameters())}
