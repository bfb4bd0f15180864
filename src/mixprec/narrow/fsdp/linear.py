"""Weights all-gathered in their layer's narrow format under FSDP2.

Without this, fully_shard all-gathers each weight in the MixedPrecisionPolicy's param_dtype
(bfloat16: 2 bytes an element) and the FP8 or microscaled Linear quantises the gathered
weight. Here each rank quantises its own rows before the all-gather, through FSDP2's
extension point: the sharded parameter's local tensor is a `NarrowShard`, whose
fsdp_pre_all_gather returns the narrow copy and its scales, and whose fsdp_post_all_gather
wraps the gathered bytes in a `GatheredWeight` that the Linear's GEMMs read as they are. The
wire and the unsharded weight then hold 1 byte an element (FP8, MXFP8) or ~0.56 (NVFP4,
MXFP4) plus the scales.

Each rank casts the bfloat16 value of its FP32 rows (what FSDP2 would have sent) with the
scale that quantising the whole weight gives those rows, so the gathered copy is, bit for
bit, the one the layer would have made after a bfloat16 gather:

    recipe        copy gathered                          needs from the other ranks
    tensorwise    e4m3, one scale                        the weight's amax: one all-reduce (MAX)
    delayed       e4m3, the history's scale              the amax the history records: the same
    rowwise       forward: e4m3, a scale per row         nothing
                  backward: e4m3, a scale per column     the columns' amaxes: an all-reduce of K
    blockwise     e4m3, a scale per 128x128 block        nothing, if each rank's rows end on a block
    mxfp8, mxfp4  forward: 1x32 blocks along K           nothing
                  backward: 32x1 blocks along N          nothing, if each rank's rows end on a block
    nvfp4         e2m1 in 16x16 blocks, for both GEMMs   the tensor scale's amax: one all-reduce

Where one copy serves the forward GEMM (W) and the input gradient's (W^T), every gather sends
it. Where the two GEMMs scale along different dimensions (row-wise, MX's 1-D blocks), each
gather sends only the copy its pass needs: the forward's in forward, the input gradient's in
backward, when FSDP2 gathers again after resharding. Both copies fill the same buffers (same
sizes: the column scales are spread over the rows' scale slots), read one way by the forward
and the other by the backward, so a compiled graph that saved the buffers in forward finds
the backward's copy in them. Sending both copies would cost as many bytes as bfloat16: where
one gather has to serve both passes (a unit not resharded after forward, a block that
recomputes its forward in backward), such a layer gathers in bfloat16, and says so.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from mixprec.dtypes import dtype_name
from mixprec.narrow.formats.gathered import BACKWARD, FORWARD, GatheredWeight
from mixprec.narrow.linear.fp8 import FP8Linear
from mixprec.narrow.formats.microscaling import E2M1, E8M0
from mixprec.narrow.formats.mx import MXRecipe
from mixprec.narrow.formats.recipe import E4M3, FP8Recipe, Granularity
from mixprec.narrow.formats.scaling import DelayedScales, amax_to_scale, cast, quantize, tile_amax

logger = logging.getLogger(__name__)

aten = torch.ops.aten


def kind(recipe: FP8Recipe) -> str:
    """How a recipe's weight travels: tensor (one scale), row, block (128x128), mx (1-D
    blocks), nv16 (NVFP4's 16x16 blocks)."""
    if isinstance(recipe, MXRecipe):
        return "nv16" if recipe.weight_2d else "mx"
    return {Granularity.TENSORWISE: "tensor", Granularity.ROWWISE: "row", Granularity.BLOCKWISE: "block"}[
        recipe.granularity]


def per_pass(recipe: FP8Recipe) -> bool:
    """Whether the forward GEMM and the input gradient's scale the weight along different
    dimensions, so each pass gathers its own copy."""
    return kind(recipe) in ("row", "mx")


def block_rows(recipe: FP8Recipe) -> int:
    """Rows one of the recipe's weight blocks spans: each rank's rows must end on them."""
    return recipe.block if kind(recipe) in ("block", "mx", "nv16") else 1


def copy_bytes(recipe: FP8Recipe, rows: int, cols: int) -> int:
    """Bytes of one gathered copy of a (rows, cols) weight, scales included (what the wire
    carries per gather, and the unsharded weight holds)."""
    k = kind(recipe)
    if k == "tensor":
        return rows * cols
    if k == "row":
        return rows * cols + 4 * rows * _scale_slots(rows, cols)
    if k == "block":
        return rows * cols + 4 * (rows // recipe.block) * math.ceil(cols / recipe.block)
    element = rows * cols // 2 if recipe.element == E2M1 else rows * cols
    if k == "mx":
        return element + rows * cols // recipe.block
    return element + (rows // recipe.block) * (cols // recipe.block)


def _scale_slots(rows: int, cols: int) -> int:
    """FP32 scale slots per row of a row-wise copy: one row scale forward; in backward the
    `cols` column scales spread over all rows' slots."""
    return max(1, math.ceil(cols / rows))


def why_not(recipe: FP8Recipe, shape: tuple[int, int], world: int, *, recomputes: bool, reshards: bool) -> str | None:
    """Why a weight of `shape` in `recipe` is gathered in bfloat16 over `world` shards, or None."""
    rows, cols = shape
    if world == 1:
        return passes_why_not(recipe, world, recomputes, reshards)
    if rows % world:
        return f"its {rows} rows do not split evenly over {world} ranks (FSDP2 pads the last shard)"
    b = block_rows(recipe)
    if (rows // world) % b:
        return (f"each rank's {rows // world} rows do not end on the recipe's {b}-row blocks, so a block would span "
                f"two ranks")
    if kind(recipe) == "mx" and cols % recipe.block:
        return f"its {cols} columns are not whole {recipe.block}-element blocks"
    return passes_why_not(recipe, world, recomputes, reshards)


def passes_why_not(recipe: FP8Recipe, world: int, recomputes: bool, reshards: bool) -> str | None:
    """What a Linear's and an experts projection's gathers share: one rank, and a recipe that needs a copy per
    pass where one gather has to serve both."""
    if world == 1:  # torch 2.13's FSDP2 copies the first all-gather input alone on one rank
        return "one rank: FSDP2 copies the shard instead of all-gathering it, so nothing crosses a wire"
    if per_pass(recipe) and (recomputes or not reshards):
        where = "its block recomputes its forward in backward" if recomputes else "its unit is not resharded after forward"
        return (f"{where}, so one gather would have to carry the forward's and the input gradient's copies: as many "
                "bytes as bfloat16")
    return None


# ---- the sharded weight -----------------------------------------------------------------------
# FSDP2 pads, slices, copies and moves the local shard: those results stay NarrowShards
_KEEP = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
         aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
         aten.clone.default, aten.detach.default, aten.alias.default}


class NarrowShard(torch.Tensor):
    """The local shard of a narrow-format Linear's weight as fully_shard holds it: the
    stored values (FP32 masters), which every op but FSDP2's all-gather sees as a plain
    tensor (the optimizer, clipping, checkpoints: it pickles as its plain values)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, gather=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, gather=None):
        self._tensor = tensor
        self._gather = gather  # an experts projection's ExpertsGather (a Linear's is its module's narrow_gather)

    def __tensor_flatten__(self):
        return ["_tensor"], self._gather

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return NarrowShard(inner["_tensor"], spec)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        gather = next((a._gather for a in args if isinstance(a, NarrowShard)), None)
        args, kwargs = tree_map_only(NarrowShard, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return tree_map_only(torch.Tensor, lambda t: NarrowShard(t, gather), out) if func in _KEEP else out

    def __reduce_ex__(self, protocol):
        return self._tensor.__reduce_ex__(protocol)

    def __repr__(self):
        return f"NarrowShard({self._tensor!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        # an experts projection's gather, carried by its shard (mixprec.narrow.fsdp.experts), or a Linear's
        gather = self._gather or module.narrow_gather
        return gather.pre(self._tensor.to(mp_policy.param_dtype or self.dtype), mesh)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        gather, which, *meta = metadata
        return gather.post(outputs, which, *meta, param_dtype, out)


class NarrowGather:
    """One Linear's low-precision all-gather: what each gather sends, and the FSDP2 unit it
    belongs to (set after fully_shard). Kept on the module as `narrow_gather`."""

    def __init__(self, module, recipe: FP8Recipe, shape: tuple[int, int]):
        self.module, self.recipe, self.shape = module, recipe, shape
        self.how = (kind(recipe), shape, recipe.block, element_format(recipe))
        self.group = self.fsdp_param = None  # FSDP2's param group (its training state) and this weight's FSDPParam
        self.narrow = True  # what the last gather sent: the narrow copy, or bfloat16 (the layer promoted)

    # -- before the all-gather, on each rank's rows
    def pre(self, w: torch.Tensor, mesh):
        narrow = bool(self.module.fp8_enabled)
        if narrow != self.narrow:  # a promotion, or its undoing: other buffers from now on
            self.narrow = narrow
            _restart(self.fsdp_param)
        if not narrow:
            return (w,), (self, None, None)
        which = BACKWARD if self._in_backward() else FORWARD
        inputs, meta = self._shard_copy(w, which, mesh.get_group(), mesh.get_local_rank(), mesh.size())
        return inputs, (self, which, meta)

    def _in_backward(self) -> bool:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        # FSDP2's own record of why it gathers (set for the prefetched units too)
        return self.group is not None and self.group._training_state == TrainingState.PRE_BACKWARD

    def _shard_copy(self, w: torch.Tensor, which: str, group, rank: int, world: int):
        r = self.recipe
        k, (N, K) = self.how[0], self.shape
        n = w.shape[0]
        if k == "tensor":
            amax = _all_max(tile_amax(w, tuple(w.shape)), group)  # (1, 1)
            scale = amax_to_scale(amax, E4M3, r.power_of_2_scales)
            if r.delayed:  # the history records the whole weight's amax, and the scale comes from it once known
                history, pending, scales = self.module.matmul_state()
                role = DelayedScales.WEIGHT
                pending[role] = torch.maximum(pending[role], amax.reshape(()))
                scale = torch.where(scales[role] > 0, scales[role], scale.reshape(())).reshape(1, 1)
            q = cast(w, scale, tuple(w.shape), E4M3)
            return (q.data,), q.scale_inv
        if k == "row":
            slots = _scale_slots(N, K)
            if which == FORWARD:
                q, _ = quantize(w, E4M3, r.tiles.w, power_of_2=r.power_of_2_scales)  # a scale per row, along K
                scales = torch.zeros(n, slots, device=w.device)
                scales[:, :1] = q.scale_inv
                return (q.data, scales), None
            amax = _all_max(tile_amax(w, (n, 1)), group)  # (1, K): each column's amax over all N rows
            q = cast(w, amax_to_scale(amax, E4M3, r.power_of_2_scales), (n, 1), E4M3)
            spread = torch.ones(N * slots, device=w.device)
            spread[:K] = q.scale_inv.reshape(-1)
            return (q.data, spread.view(N, slots)[rank * n:(rank + 1) * n]), None
        if k == "block":
            q, _ = quantize(w, E4M3, r.tiles.w, power_of_2=r.power_of_2_scales)
            return (q.data, q.scale_inv), None
        if k == "nv16":
            q = r.quantize(w, square=True, amax=_all_max(w.abs().amax().float(), group))
            return (q.data, q.scale), q.tensor_scale
        if which == FORWARD:  # mx, 1 x block along K
            q = r.quantize(w)
            return (q.data, q.scale), None
        q = r.quantize(w.t())  # (K, n) in 1 x block blocks along n, sent as rows of W
        data = q.data.view(torch.uint8).t().contiguous()
        scale = q.scale.view(torch.uint8).t().contiguous()
        fwd_cols = K // 2 if q.data.dtype == E2M1 else K
        return (data.view(n, fwd_cols).view(q.data.dtype), scale.view(n, K // r.block).view(E8M0)), None

    # -- after it, on the gathered buffers
    def post(self, outputs, which, meta, param_dtype, out):
        if which is None:  # bfloat16
            return None if out is not None else (outputs[0], tuple(outputs))
        data, scale = outputs[0], (outputs[1] if len(outputs) > 1 else None)
        if out is not None:  # the same buffers, refilled; only a scale sent beside them is new
            if meta is not None:
                out._meta = meta
            return None
        return GatheredWeight(data, scale, meta, self.how, param_dtype), tuple(outputs)


def _all_max(t: torch.Tensor, group) -> torch.Tensor:
    """The elementwise max of `t` over the shard group (amaxes: max is exact in any order)."""
    t = t.float().clone()
    if group is not None:  # None: the whole weight is here (a test's single shard)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def _restart(fsdp_param) -> None:
    """Make FSDP2 allocate this weight's all-gather buffers and unsharded parameter afresh at
    its next gather: it sizes them once, at the first, and the promoted layer's bfloat16
    gather (or the narrow one, back) sends other tensors. Between steps, when it is sharded."""
    fsdp_param.all_gather_outputs = []
    fsdp_param._unsharded_inner_tensors = []
    if hasattr(fsdp_param, "_unsharded_param"):
        del fsdp_param._unsharded_param


# ---- setting it up ----------------------------------------------------------------------------
def shard_narrow(model: nn.Module, world: int, *, reshards, recomputes) -> dict[str, str | None]:
    """Before fully_shard: make each low-precision Linear's weight a NarrowShard (the same
    storage) where its copy can be gathered narrow over `world` shards. reshards(fqn) and
    recomputes(fqn): whether the layer's unit reshards after forward and whether its block
    recomputes its forward in backward. Returns {fqn: None (narrow) or why it gathers in bfloat16}."""
    decided = {}
    for fqn, m in model.named_modules():
        if not isinstance(m, FP8Linear):
            continue
        shape = tuple(m.weight.shape)
        why = why_not(m.plan.recipe, shape, world, recomputes=recomputes(fqn), reshards=reshards(fqn))
        decided[fqn] = m.gather_why = why
        if why is None:
            m.weight = nn.Parameter(NarrowShard(m.weight.data), requires_grad=m.weight.requires_grad)
            m.narrow_gather = NarrowGather(m, m.plan.recipe, shape)
    return decided


def fsdp_params(model: nn.Module):
    """(unit, its FSDP2 param group, an FSDPParam of it) for every parameter fully_shard manages."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            yield unit, group, fsdp_param


def attach_units(model: nn.Module) -> None:
    """After fully_shard: tell each NarrowGather its FSDP2 param group (whose training state
    says forward or backward) and its FSDPParam (restarted when a promotion changes what it
    gathers)."""
    for _, group, fsdp_param in fsdp_params(model):
        info = fsdp_param._module_info
        gather = getattr(info.module, "narrow_gather", None) if info.param_name == "weight" else None
        gather = gather or getattr(info.module, "experts_gathers", {}).get(info.param_name)
        if gather is not None:
            gather.group, gather.fsdp_param = group, fsdp_param


def log_decisions(model: nn.Module, decided: dict[str, str | None], base: torch.dtype) -> None:
    """One line per recipe gathered narrow (with its bytes against `base`'s), one per layer not."""
    by_recipe: dict[str, list] = {}
    for fqn, why in decided.items():
        m = model.get_submodule(fqn)
        if why is None:
            by_recipe.setdefault(m.plan.recipe, []).append(m.weight.shape)
        else:
            logger.info("fsdp: %s all-gathers its weight in %s and quantises it after the gather (%s): %s", fqn,
                        dtype_name(base), m.plan.recipe.name, why)
    for recipe, shapes in by_recipe.items():
        narrow = sum(copy_bytes(recipe, *s) for s in shapes)
        wide = sum(s[0] * s[1] * base.itemsize for s in shapes)
        how = ("the forward's copy in forward, the input gradient's in backward" if per_pass(recipe)
               else "one copy for the forward and the input gradient")
        logger.info("fsdp: %d Linear layers all-gather their weights in %s (%s; %s): %.2fx the bytes of %s",
                    len(shapes), recipe.label, recipe.name, how, narrow / wide, dtype_name(base))


# ---- what the audit reads ---------------------------------------------------------------------
def element_format(recipe: FP8Recipe) -> torch.dtype:
    """The dtype of a gathered copy's elements: the forward GEMM's weight operand's."""
    (fmt,) = recipe.operand_formats[0]
    return fmt


def gathers(model: nn.Module, param_dtype: torch.dtype) -> dict[str, tuple[torch.dtype | None, torch.dtype, str | None]]:
    """Each FP8/microscaled Linear under FSDP2: (the dtype FSDP2's own buffers last gathered its
    weight's elements in, None if never; the dtype it should have: its narrow format unless a
    reason was logged for `param_dtype`; that reason)."""
    observed = {}
    for _, _, fsdp_param in fsdp_params(model):
        info = fsdp_param._module_info
        if isinstance(info.module, FP8Linear) and info.param_name == "weight":
            outputs = fsdp_param.all_gather_outputs
            observed[info.module] = outputs[0].dtype if outputs else None
    out = {}
    for fqn, m in model.named_modules():
        if m not in observed:
            continue
        # a layer that never went through apply_fsdp's choice is expected narrow: gathering it wide is the silent
        # fallback the audit exists to catch
        why = "promoted out of its low-precision format" if not m.fp8_enabled else getattr(m, "gather_why", None)
        planned = element_format(m.plan.recipe) if why is None else param_dtype
        out[fqn] = (observed[m], planned, why)
    return out
