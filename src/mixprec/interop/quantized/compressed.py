"""compressed-tensors' layouts (vLLM, transformers), quant_method "compressed-tensors".

Written by `mixprec export --format nvfp4 | mxfp4`, weights only (NVFP4A16, MXFP4A16):
    nvfp4-pack-quantized  `weight_packed` (two e2m1 codes a byte, the first in the low nibble), `weight_scale`
                          e4m3 per 1 x 16 group, `weight_global_scale` float32 with that format's convention (it
                          divides: weight = e2m1 x (weight_scale / global))
    mxfp4-pack-quantized  `weight_packed`, `weight_scale` the E8M0 exponent byte per 1 x 32 group
                          (weight = e2m1 x 2^(byte - 127))
mixprec's casts with the nvfp4 and mxfp4 recipes' weight settings (NVFP4: 16 x 16 blocks, one e4m3 scale serving
a block's 16 rows, written once per row as the format's 1 x 16 groups; MXFP4: 1 x 32, the scale rounded up): the
elements and block scales those recipes' forwards cast. NVFP4's tensor scale is mixprec's amax / (448 x 6),
written as its reciprocal (rounded), which a reader divides by: a block's scale then differs from the forward's
product by at most a rounding (2^-24 relative). Linears an engine fuses (q, k and v; gate and up) share one
tensor scale, from the group's largest amax (a fused GEMM reads one): theirs are cast under it, not under each
one's own as the recipe's forward casts them. A Linear whose input dimension is not a multiple of the group
stays in the export's dtype.

Read: those two and float-quantized (FP8 weights, a scale per tensor, channel, group or block), each value as
the package's decompressor computes it (NVFP4: the block scale divided by the global scale first, in float32,
then the product; the decompressor then rounds to bfloat16; float-quantized: the product in the scale's dtype).
"""

from __future__ import annotations

import logging

import torch

from mixprec.errors import UserError
from mixprec.interop.interfaces import View
from mixprec.interop.quantized.scales import ScaledWeights, block_scales, scale_values

logger = logging.getLogger(__name__)

PACKED = {"nvfp4": ("nvfp4-pack-quantized", 16), "mxfp4": ("mxfp4-pack-quantized", 32)}  # format -> (name, group)
COMPRESSED = {name: group for name, group in PACKED.values()}  # compressed-tensors formats read


def write(tensors, config, linears, kept, fmt):
    """NVFP4 or MXFP4 in compressed-tensors' pack-quantized layout, cast as the recipe of that name casts weights."""
    from mixprec.narrow.formats.microscaling import E2M1, quantize_mx, quantize_nvfp4
    from mixprec.narrow.formats.recipe import RECIPES

    name, group = PACKED[fmt]
    r = RECIPES[fmt]
    out, narrow, converted = dict(tensors), set(), 0
    shared = _shared_amax(tensors, linears) if fmt == "nvfp4" else {}
    for weight, module in linears.items():
        w = tensors[weight]
        if w.dim() != 2 or w.shape[1] % group:
            kept.append(module)
            logger.info("export: %s stays in the export's dtype: its input dimension %d is not a multiple of %s's "
                        "%d-element groups", module, w.shape[-1], fmt, group)
            continue
        R = w.shape[0]
        base = weight.removesuffix(".weight")
        if fmt == "nvfp4":
            q = quantize_nvfp4(w.float(), block=(group, group) if r.weight_2d else (1, group),
                               four_over_six=r.four_over_six, amax=shared.get(module))
            scale = q.scale.repeat_interleave(q.block[0], 0)[:R]  # a 16 x 16 block's scale on each of its rows
            out[base + ".weight_global_scale"] = q.tensor_scale.reciprocal().reshape(1)
            narrow.add(base + ".weight_global_scale")
        else:
            q = quantize_mx(w.float(), E2M1, block=group, rounding=r.scale_rounding)
            scale = q.scale.view(torch.uint8)  # the E8M0 byte, as compressed-tensors stores it
        del out[weight]
        out[base + ".weight_packed"] = q.data.view(torch.uint8)[:R].contiguous()
        out[base + ".weight_scale"] = scale.contiguous()
        narrow |= {base + ".weight_packed", base + ".weight_scale"}
        converted += 1
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": group, "dynamic": False,
               "strategy": "tensor_group" if fmt == "nvfp4" else "group",
               "scale_dtype": "torch.float8_e4m3fn" if fmt == "nvfp4" else "torch.uint8"}
    config = {**config, "quantization_config": {
        "quant_method": "compressed-tensors", "format": name, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": name}},
        "ignore": sorted(kept), "kv_cache_scheme": None}}
    logger.info("export: %d of %d Linear weights in %s (%s)", converted, len(linears), fmt, name)
    return out, config, narrow


_FUSED_GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _shared_amax(tensors, linears) -> dict[str, torch.Tensor]:
    """NVFP4's tensor amax of each Linear that an inference engine fuses with its siblings (q, k and v; gate and
    up, of an MLP or of one expert): the group's largest, so that they share one global scale, as a fused
    GEMM reads one (vLLM takes one per fused layer; llm-compressor writes them equal)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for weight, module in linears.items():
        parent, _, leaf = module.rpartition(".")
        if leaf in _FUSED_GROUPS and tensors[weight].dim() == 2:
            groups.setdefault((parent, _FUSED_GROUPS[leaf]), []).append(weight)
    shared = {}
    for members in groups.values():
        if len(members) > 1:
            amax = torch.stack([tensors[w].float().abs().amax() for w in members]).amax()
            shared.update({linears[w]: amax for w in members})
    return shared


class FloatQuantized(ScaledWeights):
    """A compressed-tensors float-quantized folder (FP8 weights) read as its weights: each e4m3 `X.weight` times
    its `X.weight_scale` (per tensor, channel, group or block, as the config's weights say), the product in the
    scale's dtype, as the package's decompressor computes it."""

    def __init__(self, folder, key: str, weights: dict):
        super().__init__(folder)
        self.strategy = weights.get("strategy")
        if self.strategy not in ("tensor", "channel", "group", "block"):
            raise UserError(f"{key} {folder.path}: compressed-tensors float-quantized weights with strategy "
                            f"{self.strategy!r}; accepted: tensor, channel, group, block")
        self.block = ((1, weights.get("group_size")) if self.strategy == "group" else
                      tuple(weights.get("block_structure") or ()) if self.strategy == "block" else None)
        self.scales = {n: n + "_scale" for n in folder.names()
                       if folder.dtype(n) in (torch.float8_e4m3fn, torch.float8_e5m2) and n + "_scale" in folder.where}
        self.hidden = set(self.scales.values()) | {n.removesuffix("weight") + "input_scale" for n in self.scales}
        logger.info("%s: %s, compressed-tensors float-quantized (%s scales): %d weights in FP8, dequantized as its "
                    "decompressor computes them", key, folder.path, self.strategy, len(self.scales))

    def _read(self, name: str, rows: slice | None) -> torch.Tensor:
        q = self.source.read(name, rows)
        if self.strategy == "tensor":
            scale = self.source.read(self.scales[name]).reshape(())
        elif self.strategy == "channel":
            scale = self.source.read(self.scales[name], rows).reshape(-1, 1)
        else:
            scale = block_scales(self.source, self.scales[name], rows, q.shape, self.block)
        return (q.to(scale.dtype) * scale).float()


class CompressedTensors(View):
    """A compressed-tensors folder in nvfp4- or mxfp4-pack-quantized read as its weights: each `X.weight_packed`
    (with `X.weight_scale`, NVFP4's `X.weight_global_scale`) as `X.weight`."""

    def __init__(self, folder, key: str, fmt: str):
        super().__init__(folder)
        self.group, self.nv = COMPRESSED[fmt], fmt.startswith("nvfp4")
        self.packed = {n.removesuffix("_packed"): n.removesuffix(".weight_packed") for n in folder.names()
                       if n.endswith(".weight_packed")}
        self.hidden = {f"{base}.{part}" for base in self.packed.values()
                       for part in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}
        for name, base in self.packed.items():
            packed, scale = tuple(folder.shape(base + ".weight_packed")), tuple(folder.shape(base + ".weight_scale"))
            want = (packed[0], 2 * packed[1] // self.group)
            if folder.dtype(base + ".weight_packed") != torch.uint8 or 2 * packed[1] % self.group or scale != want:
                raise UserError(f"{key} {folder.path}: {base}.weight_packed {list(packed)} with weight_scale "
                                f"{list(scale)}; accepted: uint8 pairs of e2m1 codes and one scale per {self.group} "
                                f"elements ({list(want)})")
        logger.info("%s: %s, compressed-tensors %s: %d weights in e2m1, dequantized as its decompressor computes them",
                    key, folder.path, fmt, len(self.packed))

    @property
    def made(self) -> dict[str, str]:
        return self.packed

    def _shape(self, name: str) -> tuple[int, ...]:
        R, half = self.source.shape(self.packed[name] + ".weight_packed")
        return R, 2 * half

    def _read(self, name: str, rows: slice | None) -> torch.Tensor:
        from mixprec.narrow.formats.microscaling import decode_e2m1

        base = self.packed[name]
        values = decode_e2m1(self.source.read(base + ".weight_packed", rows))  # (rows, C) float32
        scale = self.source.read(base + ".weight_scale", rows)
        if self.nv:  # the block scale over the global one, rounded once, as the decompressor divides
            scale = scale.float() / self.source.read(base + ".weight_global_scale").float().reshape(())
        else:
            scale = scale_values(scale)
        return values * scale.repeat_interleave(self.group, 1)
