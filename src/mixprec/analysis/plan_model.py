"""The memory of one training step of any model, planned by running that step on fake tensors.

    plan = mixprec.plan_memory(lambda: MyModel(config), "bf16-mixed", batch)
    plan["peak_bytes"], plan["by_kind"]        # parameters, gradients, optimizer, activations, ...

The model is built under PyTorch's FakeTensorMode (shapes, dtypes and devices, no data and
no memory), set up by the policy and trained for two steps; PyTorch's MemTracker follows the
second one. Every tensor the real step would allocate is allocated here, with its real
dtype, so the peak is the step's own, up to the allocator's rounding (on a tiny Hugging Face
Llama the fake peak equalled the real step's byte for byte). Nothing of the model needs to
fit in memory, which is the point. What it does not model: the loss scaler (one number), the
matmul emulation of CPUs
without BF16 hardware (a CPU artifact; planned is the program a GPU runs), and tensor
parallel (a user's model has no TP plan; `mixprec memory --tp` plans mixprec's own). FSDP2
(dp_shard > 1) is planned for rank 0 on a fake process group: fully_shard shards for real,
its collectives move no data and hold no buffers of their own, as NCCL's write in place (the
same step on real tensors under that group peaks at the planned bytes; on gloo's CPU
collectives it peaks higher by the buffer gloo's reduce-scatter allocates, up to one unit's
FP32 gradients: tests/models/test_hf.py).
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


def plan_memory(build_model, policy, batch, *, optimizer=None, loss_fn=None, dp_shard: int = 1, ep: int = 1,
                expert_dispatch: str = "base") -> dict:
    """Plan one training step of the model `build_model()` returns under `policy` (a Policy
    or a preset name) on `batch` (a tuple for `model(*batch)`, or a dict for a Hugging Face
    `model(**batch).loss`; real tensors, only their shapes are used). optimizer(params):
    the optimizer (default AdamW, with the policy's moments dtype). loss_fn(model, batch):
    the loss (default as mixprec.audit). dp_shard: FSDP2 over that many ranks (each of the
    model's decoder layers, its longest nn.ModuleList, a unit, then the root; on a fake
    process group), planned for one rank with `batch` as its micro-batch. ep: mixprec's MoE
    experts spread over that many of those ranks (mixprec.distributed.expert_parallel), planned
    at the worst load: every rank's routed rows dispatched to this rank (`expert_dispatch`:
    base or fp8). Returns bytes per kind and the peak, per device."""
    from mixprec.optim import AdamW
    from mixprec.precision import Policy

    if isinstance(policy, str):
        policy = Policy.from_preset(policy)
    elif policy.model is not None:
        raise UserError("plan_memory needs a policy that has not been set up yet (or a preset name): it sets one "
                        "up on the fake model")
    states = policy.optimizer_states
    optimizer = optimizer or (lambda params: AdamW(params, states=states) if states is not None
                              else torch.optim.AdamW(params, fused=True))
    with _quiet():  # the fake model's setup lines (paths, conversions) are not this run's
        # no loss scaler: its scale is one number read on the host, which a fake tensor has not
        planned = Policy(dataclasses.replace(policy.spec, loss_scaling=False), emulate_matmul=False,
                         tf32=policy.tf32, fp8_exclude=policy.fp8_exclude, fp8_emulate=policy.fp8_emulate)
        with _fake_ranks(dp_shard, ep) as mesh:
            return _plan(build_model, planned, policy.name, batch, optimizer, loss_fn or _loss, mesh,
                         expert_dispatch)


@contextlib.contextmanager
def _quiet():
    log = logging.getLogger("mixprec")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _fake_ranks(world: int, ep: int = 1):
    """A fake process group of `world` ranks (this process is rank 0; collectives move no
    data) and its mesh, for fully_shard to shard with (ep > 1: the trainer's expert-parallel
    mesh, mixprec.distributed.parallel); None for one rank."""
    if world == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # PyTorch's own estimators use it

    if dist.is_initialized():
        raise UserError("plan_memory with dp_shard runs its own fake process group: call it outside a distributed "
                        "job (or with dp_shard 1)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        if ep > 1:
            from mixprec.distributed.parallel import ParallelDims

            yield ParallelDims(1, world, 1, world, ep).mesh("cpu")
        else:
            yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _shard(model: torch.nn.Module, planned, mesh, expert_dispatch: str = "base") -> None:
    """The trainer's FSDP2 layout (mixprec.distributed.fsdp), after FP8 conversion as parallelize does,
    and expert parallelism where the mesh has an "ep" dimension."""
    from mixprec.distributed.expert_parallel import apply_expert_parallel
    from mixprec.distributed.fsdp import apply_fsdp
    from mixprec.distributed.parallel import ParallelDims

    planned.prepare_model(model)
    if "ep" in (mesh.mesh_dim_names or ()):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        apply_expert_parallel(model, mesh, expert_dispatch, worst_load=True)
        # FSDP2 joins each experts unit's mesh to the experts' "ep" mesh (a DeviceMesh computed from real rank
        # tensors, which the fake mode cannot compute with); the fake parameters stay fake outside the mode
        with unset_fake_temporarily():
            apply_fsdp(model, ParallelDims.dp_mesh(mesh), planned, experts_mesh=mesh["dp_mod_ep"])
    else:
        apply_fsdp(model, mesh, planned)


def _plan(build_model, planned, name: str, batch, optimizer, loss_fn, mesh=None, expert_dispatch="base") -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from mixprec.analysis.cuda_route import Workspaces
    from mixprec.narrow.gemm.fp8 import route_on
    from mixprec.narrow.formats.microscaling import byte_values
    from mixprec.narrow.formats.mx import MXRecipe
    from mixprec.narrow.formats.recipe import FP8Recipe
    from mixprec.precision.grad_norm import grad_norm

    for recipe in {f for f in planned.spec.compute_formats if isinstance(f, FP8Recipe)}:
        for _, (a_tile, b_tile), dtypes in recipe.gemms(planned.param_dtype):
            route_on("cpu", a_tile, b_tile, *dtypes)  # on real tensors now; cached for the fake model's conversion
        if isinstance(recipe, MXRecipe):  # its constants (Hadamard matrix, byte tables): real, cached, read as such
            recipe.transform(torch.device("cpu"))
            byte_values(torch.device("cpu"))
    # real inputs allowed: the constants recipes hold (NVFP4's Hadamard matrix, the byte tables) are real tensors
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = build_model()
        if mesh is not None:
            _shard(model, planned, mesh, expert_dispatch)
        opt = optimizer(model.parameters())
        model, opt = planned.setup(model, opt)
        if planned.updates is not None:  # Inductor's kernels do not run on fake tensors: the eager ones
            planned.updates.compile = False
        fake = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, batch)

        def step() -> None:
            # Policy.step's memory without its host sync (a fake tensor has no value): the
            # masters' FP32 gradients, the global norm and the clipping, the update, the
            # masters copied back
            with planned.autocast():
                loss = loss_fn(model, fake)
            planned.backward(loss)
            if planned.masters is not None:
                planned.masters.grads_to_master()
            norm, groups = grad_norm([p for g in opt.param_groups for p in g["params"] if p.grad is not None])
            for group in groups:
                torch.nn.utils.clip_grads_with_norm_(group, 1.0, norm)
            (planned.updates or opt).step()
            if planned.masters is not None:
                planned.masters.master_to_model()
            opt.zero_grad(set_to_none=True)

        step()  # the first step allocates the optimizer's states: the second is the steady one
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker, Workspaces():  # the experts operators' insides, as CUDA's route allocates them
            step()
        peak = tracker.get_tracker_snapshot("peak")
    (device, kinds), = peak.items()
    by_kind = {str(k).rsplit(".", 1)[-1].lower(): int(v) for k, v in kinds.items() if k != "Total" and v}
    return {"precision": name, "device": str(device), "peak_bytes": int(kinds["Total"]),
            "by_kind": by_kind, "parameters": sum(p.numel() for p in model.parameters())}
