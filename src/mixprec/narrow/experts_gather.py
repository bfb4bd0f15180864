"""A mixture of experts' expert weights all-gathered by FSDP2 in their narrow format.

FSDP2 shards an experts projection's weight (E, N, K) along its experts: with E a multiple of
the ranks, each rank holds whole experts. An experts layer scales each expert on its own
(mixprec.narrow.experts), so each rank casts each of its experts exactly as one process would
cast that expert's whole weight: the dense Linear's copy (mixprec.narrow.all_gather's, for one
shard), stacked along the experts. Nothing is needed from the other ranks, not even an amax:
a tensor-wise or NVFP4 tensor scale is per expert, and travels in the gather beside the bytes.
The gathered `GatheredExperts` hands each expert's copy to the dense Linear's GEMMs
(`weight[e]` is the dense `GatheredWeight`), so the experts' outputs and gradients are the
ones the layer computes after a bfloat16 gather, bit for bit.

Where it does not apply, the experts all-gather in bfloat16 and the log says why: experts
that do not split evenly over the ranks, transposed expert weights (gpt-oss's (E, K, N)),
the grouped row-wise kernel (which reads the whole weight at once), and, as for Linear
layers, a recipe whose two passes scale along different dimensions where one gather must
serve both.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from mixprec.dtypes import dtype_name
from mixprec.narrow import experts
from mixprec.narrow.all_gather import (NarrowGather, NarrowShard, _restart, copy_bytes, element_format, kind,
                                       passes_why_not)
from mixprec.narrow.gathered import GatheredWeight
from mixprec.narrow.hf_experts import projections, runs_narrow

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
    stacked (`mixprec.narrow.gathered.gathered_experts`); nothing else reads it."""

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

    def expert(self, e: int) -> GatheredWeight:
        meta = self._meta[e].reshape(self._meta_shape) if self._meta is not None else None
        return GatheredWeight(self._data[e], self._scale[e] if self._scale is not None else None, meta, self._how,
                              self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = args[0] if isinstance(args[0], GatheredExperts) else args[1]
        if func in (aten.detach.default, aten.alias.default) or (
                func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(w.shape)):
            return GatheredExperts(w._data, w._scale, w._meta, w._how, w.shape[0], w._meta_shape, w.dtype)
        if func is aten.select.int and args[1] == 0:
            return w.expert(args[2])
        if func is aten.zeros_like.default:  # the weight gradient's buffer
            return torch.zeros(w.shape, dtype=w.dtype, device=w.device)
        if func is torch.ops.mixprec.experts_mm.default:
            x, _, offs, key = args
            g = experts.gemm_of(key)
            if is_fake(x):  # the memory planner's step: the sizes only (the group sizes have no value to read)
                return x.new_empty(x.shape[0], w.shape[1], dtype=g.plan.compute_dtype)
            return experts.forward(x, w, offs, g)
        if func is torch.ops.mixprec.experts_mm_backward.default:
            x, _, offs, dy, key = args
            if is_fake(x):
                return torch.empty_like(x), x.new_empty(w.shape, dtype=w.dtype)
            return experts.backward(x, w, offs, dy, experts.gemm_of(key))
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
        copies = [self.dense._shard_copy(w[e], which, None, 0, 1) for e in range(w.shape[0])]
        inputs = tuple(torch.stack(parts) for parts in zip(*(c[0] for c in copies)))
        metas = [c[1] for c in copies]
        if metas[0] is not None:  # a per-expert tensor scale, sent beside the bytes
            inputs += (torch.stack([m.reshape(1).float() for m in metas]),)
        return inputs, (self, which, len(copies[0][0]), None if metas[0] is None else tuple(metas[0].shape))

    def post(self, outputs, which, n_inputs: int, meta_shape, param_dtype, out):
        if which is None:  # bfloat16
            return None if out is not None else (outputs[0], tuple(outputs))
        if out is not None:  # the same buffers, refilled
            return None
        data = outputs[0]
        scale = outputs[1] if n_inputs > 1 else None
        meta = outputs[n_inputs] if meta_shape is not None else None
        return GatheredExperts(data, scale, meta, self.dense.how, self.shape[0], meta_shape, param_dtype), tuple(outputs)


def shard(model: nn.Module, world: int, *, reshards, recomputes) -> dict[str, str | None]:
    """Before fully_shard: each narrow experts projection's weight a NarrowShard where it can be gathered
    narrow. Returns {projection FQN: None (narrow) or why it gathers in bfloat16}."""
    decided = {}
    for fqn, m in model.named_modules():
        if not runs_narrow(m):
            continue
        for proj, g in zip(projections(m), m.mixprec_experts.gemms):
            p = getattr(m, proj)
            why = why_not(g, tuple(p.shape), world, recomputes=recomputes(fqn), reshards=reshards(fqn))
            decided[f"{fqn}.{proj}"] = why
            if why is None:
                # the shard carries its gather: two projections of one shape (up_proj and down_proj where
                # I == H) are told apart
                gather = ExpertsGather(m, proj, tuple(p.shape), g.plan.recipe)
                setattr(m, proj, nn.Parameter(NarrowShard(p.data, gather), requires_grad=p.requires_grad))
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
