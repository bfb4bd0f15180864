"""transformers' FineGrainedFP8 / vLLM's block FP8 (DeepSeek-V3's layout), `mixprec export --format fp8-block`:
each converted Linear's `weight` in e4m3 and `weight_scale_inv` (one per 128 x 128 block, the last block of a
dimension partial), weight = e4m3 x weight_scale_inv; config.json's quantization_config {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert"}.

Written: mixprec's block-wise cast (mixprec.narrow.formats.scaling.quantize, 128 x 128 tiles, float32 scales: scale =
448 / amax, correctly rounded, its reciprocal stored), the bytes the fp8-blockwise recipe's forward casts from
the same weight. DeepSeek-V3's reference quantizer divides by amax / 448 instead of multiplying by its
reciprocal: the same scale, an element a rounding apart where the two quotients round differently. A Linear
with a dimension over 128 that is not a multiple of 128 stays in the export's dtype (named in
modules_to_not_convert, logged): readers that take the block size from the scale grid (rows // grid rows) would
place such a grid's blocks wrongly.

Read: float32, bfloat16 or ue8m0 (float8_e8m0fnu, or its bytes as uint8: 2^(byte - 127)) scales, any block
size, dequantized as the format defines (the product in float32, then the model's dtype: transformers' own
dequantization), each rank reading only its rows' blocks.
"""

from __future__ import annotations

import logging
import math

import torch

from mixprec.dtypes import dtype_name
from mixprec.errors import UserError
from mixprec.interop.quantized.scales import ScaledWeights, block_scales, scale_values

logger = logging.getLogger(__name__)

BLOCK = 128
SCALE = "_scale_inv"


def convertible(shape: tuple[int, ...]) -> bool:
    """Whether a Linear's weight is written in 128 x 128 blocks: each dimension one partial block or whole
    blocks (what a reader that takes the block size from the grid reads right)."""
    return len(shape) == 2 and all(n <= BLOCK or n % BLOCK == 0 for n in shape)


def write(tensors, config, linears, kept):
    """The decoder Linears `linears` (weight -> module) in e4m3 blocks where `convertible`; the rest kept."""
    from mixprec.narrow.formats.recipe import E4M3
    from mixprec.narrow.formats.scaling import quantize

    out, narrow = dict(tensors), set()
    for name, module in linears.items():
        w = tensors[name]
        if not convertible(tuple(w.shape)):
            kept.append(module)
            logger.info("export: %s stays in the export's dtype: its shape %s has a dimension over %d that is not "
                        "a multiple of it (readers take the block size from the scale grid)", module, list(w.shape),
                        BLOCK)
            continue
        q, _ = quantize(w.float(), E4M3, (BLOCK, BLOCK))
        out[name], out[name + SCALE] = q.data, q.scale_inv.float().contiguous()
        narrow |= {name, name + SCALE}
    config = {**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(kept)}}
    logger.info("export: %d of %d Linear weights in e4m3 with a float32 scale per %dx%d block (fp8-block)",
                len(narrow) // 2, len(linears), BLOCK, BLOCK)
    return out, config, narrow


class FineGrainedFP8(ScaledWeights):
    """A folder's tensors as the weights they stand for: each `name` with a `name_scale_inv` beside it read
    as e4m3 x its block's scale."""

    def __init__(self, folder, key: str):
        super().__init__(folder)
        block = folder.config["quantization_config"].get("weight_block_size")
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise UserError(f"{key} {folder.path}: quantization_config weight_block_size {block!r}; accepted: two "
                            "positive integers (e.g. [128, 128]) or null (one scale a tensor)")
        self.block = tuple(block) if block is not None else None
        self.scales = {n.removesuffix(SCALE): n for n in folder.names() if n.endswith(".weight" + SCALE)}
        self.hidden = set(self.scales.values()) | {n for n in folder.names()
                                                   if n.endswith((".input_scale", ".activation_scale"))}
        for name, scale in self.scales.items():
            shape, grid = folder.shape(name), tuple(folder.shape(scale))
            want = tuple(math.ceil(n / b) for n, b in zip(shape, self.block)) if self.block else None
            fits = grid == want if self.block else math.prod(grid) == 1
            if not fits:
                raise UserError(f"{key} {folder.path}: {scale!r} is {list(grid)} for a weight of {list(shape)}; "
                                f"accepted: one scale per {self.block or 'tensor'} block"
                                f"{f' ({list(want)})' if want else ''}")
        dtypes = "/".join(sorted({dtype_name(folder.dtype(s)) for s in self.scales.values()})) or "no"
        logger.info("%s: %s, FineGrainedFP8 (quant_method fp8): %d weights in e4m3 with %s scales per %s block, "
                    "dequantized as the format defines (e4m3 x weight_scale_inv)", key, folder.path,
                    len(self.scales), dtypes, "x".join(map(str, self.block or ("tensor",))))

    def _read(self, name: str, rows: slice | None) -> torch.Tensor:
        q = self.source.read(name, rows).float()
        if self.block is None:
            return q * scale_values(self.source.read(self.scales[name])).reshape(())
        return q * scale_values(block_scales(self.source, self.scales[name], rows, q.shape, self.block))
