"""The policy part that puts a precision layout into the model: the FP8 conversion (one per
recipe in the layout) and per-module compute dtypes (an autocast region around each such
Linear's forward). It keeps the original Parameter objects; the state it owns is the FP8
layers' delayed-scaling history."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch
from torch import nn

from mixprec.dtypes import dtype_name
from mixprec.narrow.formats import blockwise_cast
from mixprec.narrow.experts import hf as hf_experts
from mixprec.narrow.convert import Conversion, convert_to_fp8
from mixprec.narrow.experts.layer import ExpertsLayer
from mixprec.narrow.linear.fp8 import runs_fp8
from mixprec.narrow.formats.recipe import Granularity
from mixprec.precision.layout import Layout
from mixprec.precision.spec import FP32, Format

logger = logging.getLogger(__name__)


def _compute_in(forward, dtype: torch.dtype, device_type: str):
    """`forward` with its matmuls in `dtype`: autocast to a low-precision dtype, or autocast
    off and floating inputs widened for float32."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if dtype == FP32:
            with torch.autocast(device_type, enabled=False):
                args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
                return forward(*args, **kwargs)
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)
    return run


class ModuleFormats:
    def __init__(self, layout: Layout, emulate_fp8: bool | None = None):
        self.layout, self.emulate_fp8 = layout, emulate_fp8
        self.conversions: list[Conversion] = []
        # promoted layers' conversions (and an experts module's narrow projections), for a revert
        self._taken_out: dict[str, tuple[Conversion, ExpertsLayer | None]] = {}

    def apply(self, model: nn.Module, device_type: str) -> None:
        spec = self.layout.spec
        for recipe in self.layout.recipes():
            chosen = self.layout.fp8(recipe)
            self.conversions.append(convert_to_fp8(model, recipe, compute_dtype=spec.param_dtype, modules=chosen,
                                                   emulate=self.emulate_fp8, device_type=device_type,
                                                   experts=list(self.layout.experts(recipe))))
        for fqn, reason in self.layout.left_out().items():
            logger.info("fp8: %s stays in %s: %s", fqn, self.layout.modules[fqn].compute_name, reason)
        base = [fqn for fqn, m in self.layout.modules.items() if m.kind == "experts" and m.compute == spec.param_dtype
                and hf_experts.runs_here(model.get_submodule(fqn))]
        if base and spec.param_dtype != FP32:
            hf_experts.in_base_mode(model, base, spec.param_dtype)
            logger.info("precision: %d experts modules compute in %s on torch's grouped GEMM, their weights cast to it "
                        "as autocast casts a Linear's (%s)", len(base), dtype_name(spec.param_dtype), ", ".join(base))
        for fqn, dtype in self.layout.dtype_overrides().items():
            module = model.get_submodule(fqn)
            module.forward = _compute_in(module.forward, dtype, device_type)
            logger.info("precision: %s computes in %s (%s)", fqn, dtype_name(dtype), self.layout.modules[fqn].why)

    def probe(self, device_type: str) -> None:
        """Ask, on the device the model computes on now, what the conversions' kernels were
        asked at conversion (a model converted on the CPU or the meta device and moved there
        since, by .to or by fully_shard, which moves parameters without Module._apply): the
        block-wise Triton casts, probed and logged once per device (mixprec.narrow.formats.blockwise_cast),
        and the GEMM routes, chosen again there and said (Conversion.move). A model still on
        the CPU is left as converted: it may yet be moved (Lightning sets it up before Fabric
        moves it), and its layers' .to chooses then; but one converted on the meta device,
        which had none, gets the CPU's."""
        if device_type == "meta":
            return
        if any(c.recipe.granularity is Granularity.BLOCKWISE for c in self.conversions):
            blockwise_cast.probe(device_type)
        for c in self.conversions:
            if c.device != device_type and (device_type != "cpu" or c.device == "meta") and (c.modules or c.experts):
                c.move(device_type)

    @property
    def main(self) -> Conversion | None:
        """The conversion of the base mode's recipe (or the first, for overrides only)."""
        spec = self.layout.spec
        return next((c for c in self.conversions if c.recipe == spec.fp8), self.conversions[0]
                    if self.conversions else None)

    @property
    def fp8_layers(self) -> int:
        return sum(len(c.modules) for c in self.conversions)

    def promote(self, model: nn.Module, fqn: str, why: str) -> Format:
        """Take the FP8 layer `fqn` out of FP8: from now on its matmul is a plain Linear's, in
        the base mode's dtype. The module object stays in place (FSDP2 all-gathers into it,
        hooks hold on to it); it leaves its conversion (delayed scaling, the FP8 count).
        Returns the format it had."""
        module = model.get_submodule(fqn)
        if hf_experts.runs_narrow(module):  # an experts module: its projections back on the base mode's GEMM
            conversion = next(c for c in self.conversions if c.experts.get(fqn) is module.mixprec_experts)
            self._taken_out[fqn] = conversion, conversion.experts.pop(fqn)
            hf_experts.in_base_mode(model, [fqn], self.layout.spec.param_dtype)
        elif runs_fp8(module):
            conversion = next(c for c in self.conversions if c.modules.get(fqn) is module)
            module.fp8_enabled = False
            del conversion.modules[fqn]
            self._taken_out[fqn] = conversion, None
        else:
            raise ValueError(f"{fqn} does not compute in a narrow format")
        old = self.layout.modules[fqn]
        self.layout.modules[fqn] = replace(old, compute=self.layout.spec.param_dtype, why=why)
        return old.compute

    def revert(self, model: nn.Module, fqn: str, compute: Format, why: str) -> None:
        """Undo `promote`: the FP8 layer goes back in."""
        module, (conversion, experts) = model.get_submodule(fqn), self._taken_out.pop(fqn)
        if experts is not None:
            module.mixprec_experts = conversion.experts[fqn] = experts
        else:
            module.fp8_enabled = True
            conversion.modules[fqn] = module
        self.layout.modules[fqn] = replace(self.layout.modules[fqn], compute=compute, why=why)

    def after_step(self) -> None:
        for c in self.conversions:
            c.after_step()

    def state_dict(self) -> dict | None:
        if not self.conversions:
            return None
        state = {"recipe": self.main.recipe.name, "delayed": {}}
        for c in self.conversions:
            state["delayed"].update(c.state_dict()["delayed"])
        return state

    def load_state_dict(self, state: dict) -> None:
        for c in self.conversions:
            c.load_state_dict(state)
