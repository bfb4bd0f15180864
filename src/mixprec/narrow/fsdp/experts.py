"""A mixture of experts' expert weights all-gathered by FSDP2 in their narrow format.

FSDP2 shards an experts projection's weight (E, N, K) along its experts: with E a multiple of
the ranks, each rank holds whole experts. An experts layer scales each expert on its own
(mixprec.narrow.experts.ops), so each rank casts each of its experts exactly as one process would
cast that expert's whole weight: the dense Linear's copy (mixprec.narrow.fsdp.linear's, for one
shard), stacked along the experts. Nothing is needed from the other ranks, not even an amax:
a tensor-wise or NVFP4 tensor scale is per expert, and travels in the gather beside the bytes.
Every expert is cast in one pass over the stacked weight (`stacked_copy`). The gathered
`GatheredExperts` hands the experts' grouped passes each expert's copy (`weight[e]` is the dense
`GatheredWeight`), so the experts' outputs and gradients are the ones the layer computes after
a bfloat16 gather, bit for bit.

Where it does not apply, the experts all-gather in bfloat16 and the log says why: experts
that do not split evenly over the ranks, transposed expert weights (gpt-oss's (E, K, N)),
and, as for Linear layers, a recipe whose two passes scale along different dimensions where
one gather must serve both.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from mixprec.dtypes import dtype_name
from mixprec.narrow.experts import ops as experts
from mixprec.narrow.experts import fp8 as experts_fp8
from mixprec.narrow.fsdp.linear import (NarrowGather, NarrowShard, _restart, _scale_slots, copy_bytes, element_format,
                                       kind, passes_why_not)
from mixprec.narrow.formats.gathered import FORWARD, GatheredWeight
from mixprec.narrow.formats.microscaling import E2M1, E8M0, Blocked
from mixprec.narrow.formats.recipe import E4M3
from mixprec.narrow.formats.scaling import Quantized
from mixprec.narrow.experts.segments import pad_to
from mixprec.narrow.experts.hf import projections, runs_narrow

logger = logging.getLogger(__name__)
aten = torch.ops.aten


def why_not(g: experts.ExpertsGemm, shape: tuple[int, int, int], world: int, *, recomputes: bool,
            reshards: bool) -> str | None:
    """Why an experts projection of `shape` (E, N, K) gathers in bfloat16 over `world` shards, or None."""
    E, N, K = shape
    recipe = g.plan.recipe
    if world == 1:
        return passes_why_not(recipe, world, recomputes, reshards)
    if E % world:
        return f"its {E} experts do not split evenly over {world} ranks"
    if g.transposed:
        return "its expert weights are stored transposed (E, K, N): the Linear's copies are (N, K)"
    if kind(recipe) == "mx" and K % recipe.block:
        return f"its {K} columns are not whole {recipe.block}-element blocks"
    return passes_why_not(recipe, world, recomputes, reshards)


class GatheredExperts(torch.Tensor):
    """An experts projection's all-gathered weight (E, N, K) in its narrow format: each expert's
    dense copy stacked. `weight[e]` is expert e's `GatheredWeight`; the experts operators run
    stacked (`mixprec.narrow.formats.gathered.gathered_experts`); nothing else reads it."""

    @staticmethod
    def __new__(cls, data, scale, meta, how: tuple, n_experts: int, meta_shape, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, (n_experts, *how[1]), dtype=dtype, device=data.device,
                                                   requires_grad=False)

    def __init__(self, data, scale, meta, how: tuple, n_experts: int, meta_shape, dtype: torch.dtype):
        self._data, self._scale, self._meta, self._how, self._meta_shape = data, scale, meta, how, meta_shape

    def __tensor_flatten__(self):  # a traceable subclass: compiled code takes it as an input, no graph break
        names = [n for n in ("_data", "_scale", "_meta") if getattr(self, n) is not None]
        return names, (self._how, self.shape[0], self._meta_shape, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        how, n_experts, meta_shape, dtype = spec
        return GatheredExperts(inner["_data"], inner.get("_scale"), inner.get("_meta"), how, n_experts, meta_shape,
                               dtype)

    def stacked(self, which: str) -> Quantized | Blocked:
        """Every expert's gathered copy for `which` pass at once, as GatheredWeight.copy reads one:
        data (E, ...) and scales (E, ...) stacked, views of the gathered buffers where the layout allows."""
        k, (N, K), b, element = self._how
        E = self.shape[0]
        if k == "tensor":
            return Quantized(self._data, self._meta.reshape(E, 1, 1), (N, K))
        if k == "block":
            return Quantized(self._data, self._scale, (b, b))
        if k == "nv16":
            return Blocked(self._data, self._scale, (b, b), self._meta.reshape(E), (N, K))
        if k == "row":
            if which == FORWARD:
                return Quantized(self._data, self._scale[:, :, :1], (1, K))
            return Quantized(self._data, self._scale.reshape(E, -1)[:, :K].reshape(E, 1, K), (N, 1))
        if which == FORWARD:  # mx
            return Blocked(self._data, self._scale, (1, b), None, (N, K))
        rows = N // 2 if element == E2M1 else N  # e2m1 packs two rows of W^T's columns per byte
        data = self._data.view(torch.uint8).view(E, rows, K).transpose(1, 2).contiguous().view(self._data.dtype)
        scale = self._scale.view(torch.uint8).view(E, N // b, K).transpose(1, 2).contiguous().view(E8M0)
        return Blocked(data, scale, (1, b), None, (K, N))

    def expert(self, e: int) -> GatheredWeight:
        meta = self._meta[e].reshape(self._meta_shape) if self._meta is not None else None
        return GatheredWeight(self._data[e], self._scale[e] if self._scale is not None else None, meta, self._how,
                              self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = next(a for a in args if isinstance(a, GatheredExperts))
        if func in (aten.detach.default, aten.alias.default) or (
                func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(w.shape)):
            return GatheredExperts(w._data, w._scale, w._meta, w._how, w.shape[0], w._meta_shape, w.dtype)
        if func is aten.select.int and args[1] == 0:
            return w.expert(args[2])
        if func is aten.zeros_like.default:  # the weight gradient's buffer
            return torch.zeros(w.shape, dtype=w.dtype, device=w.device)
        if func is torch.ops.mixprec.experts_mm.default:
            x, _, offs, _, key = args
            g = experts.gemm_of(key)
            if is_fake(x):  # the memory planner's step: the sizes only (the group sizes have no value to read)
                return x.new_empty(x.shape[0], w.shape[1], dtype=g.plan.compute_dtype)
            return experts.forward(x, w, offs, g)
        if func is torch.ops.mixprec.experts_mm_backward.default:
            x, _, offs, dy, salts, key = args
            if is_fake(x):
                return torch.empty_like(x), x.new_empty(w.shape, dtype=w.dtype)
            return experts.backward(x, w, offs, dy, experts.gemm_of(key), salts)
        if func is torch.ops.mixprec.experts_mm_cast_input.default:  # rows that arrived cast (expert parallel)
            x, x_data, x_scale_inv, _, offs, key = args
            return experts.experts_mm_cast_input(x, x_data, x_scale_inv, w, offs, key)
        if func is torch.ops.mixprec.experts_mm_cast_input_backward.default:
            x_data, x_scale_inv, _, offs, dy, key, dtype = args
            return experts.experts_mm_cast_input_backward(x_data, x_scale_inv, w, offs, dy, key, dtype)
        raise RuntimeError(f"{func} on expert weights all-gathered in their narrow format: only mixprec's experts "
                           "operators read them (set parallelism.lowp_all_gather = false to gather in bfloat16)")

    def __repr__(self):
        return f"GatheredExperts({self._how[0]}, {tuple(self.shape)}, {self._data.dtype})"


class ExpertsGather:
    """One experts projection's low-precision all-gather, as NarrowGather is a Linear's."""

    def __init__(self, module: nn.Module, name: str, shape: tuple[int, int, int], recipe):
        self.module, self.name, self.shape = module, name, shape
        self.dense = NarrowGather(None, recipe, shape[1:])  # one expert's copy, as a whole weight on one rank
        self.group = self.fsdp_param = None
        self.narrow = True

    def pre(self, w: torch.Tensor, mesh):
        narrow = runs_narrow(self.module)
        if narrow != self.narrow:  # a promotion, or its undoing
            self.narrow = narrow
            _restart(self.fsdp_param)
        if not narrow:
            return (w,), (self, None, 0, None)
        self.dense.group = self.group
        which = "backward" if self.dense._in_backward() else "forward"
        inputs, meta, meta_shape = stacked_copy(self.dense.recipe, kind(self.dense.recipe), w, which)
        if meta is not None:  # a per-expert tensor scale, sent beside the bytes
            return (*inputs, meta), (self, which, len(inputs), meta_shape)
        return inputs, (self, which, len(inputs), None)

    def post(self, outputs, which, n_inputs: int, meta_shape, param_dtype, out):
        if which is None:  # bfloat16
            return None if out is not None else (outputs[0], tuple(outputs))
        if out is not None:  # the same buffers, refilled
            return None
        data = outputs[0]
        scale = outputs[1] if n_inputs > 1 else None
        meta = outputs[n_inputs] if meta_shape is not None else None
        return GatheredExperts(data, scale, meta, self.dense.how, self.shape[0], meta_shape, param_dtype), tuple(outputs)


def _per_expert(values: torch.Tensor, E: int) -> torch.Tensor:
    """(E, 1) FP32 with unit strides, as FSDP2 views each all-gather input as bytes (a size-1 dimension's
    stride included)."""
    return values.reshape(E).float().contiguous()[:, None]


def stacked_copy(r, k: str, w: torch.Tensor, which: str):
    """Every expert's copy of w (E, N, K) for `which` pass at once, each the bytes the dense layer's
    gather sends for that expert's whole weight on one rank (NarrowGather._shard_copy): (the tensors to
    gather, stacked along the experts; the per-expert tensor scales (E, 1) or None; one expert's scale
    shape). One cast over the stacked weight, scales per expert (mixprec.narrow.experts.fp8.cast_stacked,
    the microscaled casts of the stack's rows): no loop over the experts."""
    E, N, K = w.shape
    pow2 = r.power_of_2_scales
    if k == "tensor":
        q = experts_fp8.cast_stacked(w, (0, 0), E4M3, pow2)
        return (q.data,), _per_expert(q.scale_inv, E), (1, 1)
    if k == "row":
        slots = _scale_slots(N, K)
        if which == FORWARD:  # a scale per row along K, in each row's first slot
            q = experts_fp8.cast_stacked(w, r.tiles.w, E4M3, pow2)
            scales = torch.zeros(E, N, slots, device=w.device)
            scales[:, :, :1] = q.scale_inv
            return (q.data, scales), None, None
        q = experts_fp8.cast_stacked(w, (0, 1), E4M3, pow2)  # each column's amax over the expert's N rows
        spread = torch.ones(E, N * slots, device=w.device)
        spread[:, :K] = q.scale_inv.reshape(E, K)
        return (q.data, spread.view(E, N, slots)), None, None
    if k == "block":
        q = experts_fp8.cast_stacked(w, r.tiles.w, E4M3, pow2)
        return (q.data.contiguous(), q.scale_inv), None, None
    if k == "nv16":  # 16 x 16 blocks per expert, its tensor scale from its own amax
        rows = -(-N // r.block) * r.block
        amax = w.abs().float().amax(dim=(1, 2))
        q = r.quantize(pad_to(w, r.block, dim=1).reshape(E * rows, K), square=True,
                       amax=amax.repeat_interleave(rows // r.block)[:, None])
        ts = _per_expert(q.tensor_scale.view(E, rows // r.block)[:, 0], E)
        return (q.data.view(E, rows, -1), q.scale.view(E, rows // r.block, -1)), ts, ()
    if which == FORWARD:  # mx, 1 x block along K: the stack's rows
        q = r.quantize(w.reshape(E * N, K))
        return (q.data.view(E, N, -1), q.scale.view(E, N, -1)), None, None
    q = r.quantize(w.transpose(1, 2).reshape(E * K, N))  # each expert's W^T (K, N) along N, sent as rows of W
    data = q.data.view(torch.uint8).view(E, K, -1).transpose(1, 2).contiguous()
    scale = q.scale.view(torch.uint8).view(E, K, -1).transpose(1, 2).contiguous()
    fwd_cols = K // 2 if q.data.dtype == E2M1 else K
    return (data.view(E, N, fwd_cols).view(q.data.dtype), scale.view(E, N, K // r.block).view(E8M0)), None, None


def shard(model: nn.Module, world: int, *, reshards, recomputes, experts_world: int = 1) -> dict[str, str | None]:
    """Before fully_shard: each narrow experts projection's weight a NarrowShard where it can be gathered
    narrow. Returns {projection FQN: None (narrow) or why it gathers in bfloat16}. Expert-parallel experts
    (their weights DTensors of this rank's experts, mixprec.distributed.expert_parallel) gather over the
    `experts_world` ranks outside their group: the DTensor's local tensor becomes the NarrowShard."""
    from torch.distributed.tensor import DTensor

    decided = {}
    for fqn, m in model.named_modules():
        if not runs_narrow(m):
            continue
        for proj, g in zip(projections(m), m.mixprec_experts.gemms):
            p = getattr(m, proj)
            local = p.detach().to_local() if isinstance(p, DTensor) else p.data
            why = why_not(g, tuple(local.shape), experts_world if isinstance(p, DTensor) else world,
                          recomputes=recomputes(fqn), reshards=reshards(fqn))
            decided[f"{fqn}.{proj}"] = why
            if why is None:
                # the shard carries its gather: two projections of one shape (up_proj and down_proj where
                # I == H) are told apart
                gather = ExpertsGather(m, proj, tuple(local.shape), g.plan.recipe)
                data = NarrowShard(local, gather)
                if isinstance(p, DTensor):
                    data = DTensor.from_local(data, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                              stride=p.stride())
                setattr(m, proj, nn.Parameter(data, requires_grad=p.requires_grad))
                m.__dict__.setdefault("experts_gathers", {})[proj] = gather
    return decided


def log_decisions(model: nn.Module, decided: dict[str, str | None], base: torch.dtype) -> None:
    narrow = [(fqn, model.get_parameter(fqn)) for fqn, why in decided.items() if why is None]
    for fqn, why in decided.items():
        if why is not None:
            logger.info("fsdp: %s all-gathers its experts in %s and quantises them after the gather: %s", fqn,
                        dtype_name(base), why)
    if narrow:
        recipe = model.get_submodule(narrow[0][0].rpartition(".")[0]).mixprec_experts.gemms[0].plan.recipe
        bytes_narrow = sum(p.shape[0] * copy_bytes(recipe, *p.shape[1:]) for _, p in narrow)
        wide = sum(p.numel() * base.itemsize for _, p in narrow)
        logger.info("fsdp: %d experts projections all-gather their experts in %s, each expert's copy cast on its "
                    "rank (%s): %.2fx the bytes of %s", len(narrow), dtype_name(element_format(recipe)), recipe.name,
                    bytes_narrow / wide, dtype_name(base))
