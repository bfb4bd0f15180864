"""Narrow formats that inference engines load, in a Hugging Face folder: written by `mixprec export --format`,
read back as the weights they stand for by every loader of a folder.

    fp8-block  transformers' FineGrainedFP8 / vLLM's block FP8 (DeepSeek-V3's layout): each converted Linear's
               `weight` in e4m3 and `weight_scale_inv` (one per 128 x 128 block, the last block of a dimension
               partial), weight = e4m3 x weight_scale_inv; config.json's quantization_config
               {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
               [128, 128], "modules_to_not_convert": [...]}

    nvfp4      compressed-tensors' nvfp4-pack-quantized (vLLM, transformers): `weight_packed` (two e2m1 codes a
               byte, the first in the low nibble), `weight_scale` e4m3 per 1 x 16 group, `weight_global_scale`
               float32 with that format's convention (it divides: weight = e2m1 x (weight_scale / global));
               quant_method "compressed-tensors", weights only (NVFP4A16)
    mxfp4      compressed-tensors' mxfp4-pack-quantized: `weight_packed`, `weight_scale` the E8M0 exponent byte per
               1 x 32 group (weight = e2m1 x 2^(byte - 127)), weights only (MXFP4A16)

    mxfp4 of a gpt-oss model: its own layout, which transformers reads for the family: each experts tensor
               (E, K, N) as `X_blocks` (E, N, K/32, 16), two e2m1 codes a byte, and `X_scales` (E, N, K/32),
               the E8M0 exponent bytes; quantization_config {"quant_method": "mxfp4"}; attention, routers,
               embeddings and the head stay in the export's dtype, as the family's checkpoints keep them

    tensors, config = quantize_folder(tensors, config, linears, kept, "fp8-block")    # export
    source = dequantized(folder, key)       # a folder with a quantization_config, as its dequantized weights

Exported, a weight's e4m3 elements and scales are mixprec's block-wise cast (mixprec.narrow.scaling.quantize,
128 x 128 tiles, float32 scales: scale = 448 / amax, correctly rounded, its reciprocal stored), the bytes the
fp8-blockwise recipe's forward casts from the same weight. DeepSeek-V3's reference quantizer divides by
amax / 448 instead of multiplying by its reciprocal: the same scale, an element a rounding apart where the two
quotients round differently. A Linear with a dimension over 128 that is not a multiple of 128 stays in the
export's dtype (named in modules_to_not_convert, logged): readers that take the block size from the scale grid
(rows // grid rows) would place such a grid's blocks wrongly.

NVFP4 and MXFP4 are mixprec's casts with the nvfp4 and mxfp4 recipes' weight settings (NVFP4: 16 x 16 blocks, one
e4m3 scale serving a block's 16 rows, written once per row as the format's 1 x 16 groups; MXFP4: 1 x 32, the
scale rounded up): the elements and block scales those recipes' forwards cast. NVFP4's tensor scale is mixprec's
amax / (448 x 6), written as its reciprocal (rounded), which a reader divides by: a block's scale then differs from
the forward's product by at most a rounding (2^-24 relative). Linears an engine fuses (q, k and v; gate and up)
share one tensor scale, from the group's largest amax (a fused GEMM reads one): theirs are cast under it, not
under each one's own as the recipe's forward casts them. A Linear whose input dimension is not a multiple of the
group stays in the export's dtype.

Read (checkpoint.initial_load, generate, load_model): FineGrainedFP8 folders with float32, bfloat16 or ue8m0
(float8_e8m0fnu, or its bytes as uint8: 2^(byte - 127)) scales, any block size, dequantized as the format
defines (the product in float32, then the model's dtype: transformers' own dequantization), each rank reading
only its rows' blocks; compressed-tensors folders in nvfp4-pack-quantized, mxfp4-pack-quantized or
float-quantized (FP8 weights, a scale per tensor, channel, group or block), as that package's decompressor
computes each value (in float32: NVFP4's block scale divided by the global scale first,
then the product; the decompressor then rounds to bfloat16, the model's dtype here). Any other
quantization_config is refused in one line.
"""

from __future__ import annotations

import logging
import math

import torch

from mixprec.errors import UserError

logger = logging.getLogger(__name__)

FORMATS = ("bf16", "fp8-block", "nvfp4", "mxfp4")  # mixprec export --format: the export dtype as it is, or a narrow one
READ = {"fp8": "FineGrainedFP8 (e4m3 weights, weight_scale_inv per block)",  # quant_method -> what is read
        "compressed-tensors": "formats nvfp4-pack-quantized, mxfp4-pack-quantized, float-quantized",
        "mxfp4": "gpt-oss's MXFP4 experts (_blocks, _scales)"}
PACKED = {"nvfp4": ("nvfp4-pack-quantized", 16), "mxfp4": ("mxfp4-pack-quantized", 32)}  # format -> (name, group)
COMPRESSED = {name: group for name, group in PACKED.values()}  # compressed-tensors formats read
BLOCK = 128
SCALE = "_scale_inv"


def convertible(shape: tuple[int, ...]) -> bool:
    """Whether a Linear's weight is written in 128 x 128 blocks: each dimension one partial block or whole
    blocks (what a reader that takes the block size from the grid reads right)."""
    return len(shape) == 2 and all(n <= BLOCK or n % BLOCK == 0 for n in shape)


def quantize_folder(tensors: dict[str, torch.Tensor], config: dict, linears: dict[str, str], kept: list[str],
                    fmt: str) -> tuple[dict[str, torch.Tensor], dict, set[str]]:
    """(tensors, config.json, the names written as they are) in `fmt`: each of `linears` (folder name of a
    Linear's weight -> the Linear's folder name) converted where the format takes its shape; the Linears `kept`
    (the head, routers) and the others named as left out (modules_to_not_convert, or compressed-tensors' ignore)."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not known; accepted: {', '.join(FORMATS)}")
    if fmt == "bf16":
        return tensors, config, set()
    if own_layout(fmt, config):
        return _gpt_oss(tensors, config)
    if fmt in PACKED:
        return _packed(tensors, config, linears, list(kept), fmt)
    return _fp8_block(tensors, config, linears, list(kept))


def _fp8_block(tensors, config, linears, kept):
    from mixprec.narrow.recipe import E4M3
    from mixprec.narrow.scaling import quantize

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


def _packed(tensors, config, linears, kept, fmt):
    """NVFP4 or MXFP4 in compressed-tensors' pack-quantized layout, cast as the recipe of that name casts weights."""
    from mixprec.narrow.microscaling import E2M1, quantize_mx, quantize_nvfp4
    from mixprec.narrow.recipe import RECIPES

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


def own_layout(fmt: str, config: dict) -> bool:
    """Whether the model family has a layout of its own for `fmt` that holds its fused experts (gpt-oss's MXFP4)."""
    return fmt == "mxfp4" and config.get("model_type") == "gpt_oss"


def _gpt_oss(tensors, config):
    """gpt-oss's experts in its MXFP4 layout, cast as the mxfp4 recipe casts weights (1 x 32, the scale rounded
    up), along each expert's input dimension."""
    from mixprec.narrow.microscaling import E2M1, quantize_mx
    from mixprec.narrow.recipe import RECIPES

    out, narrow = {}, set()
    for name, w in tensors.items():
        if not (name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and w.dim() == 3):
            out[name] = w
            continue
        E, K, N = w.shape
        if K % 32:
            raise UserError(f"--format mxfp4: {name} sums over {K} elements, not a multiple of 32; accepted: a "
                            "gpt-oss model whose hidden and intermediate sizes are multiples of 32")
        q = quantize_mx(w.transpose(1, 2).reshape(E * N, K).float(), E2M1, rounding=RECIPES["mxfp4"].scale_rounding)
        out[name + "_blocks"] = q.data.view(torch.uint8).reshape(E, N, K // 32, 16)
        out[name + "_scales"] = q.scale.view(torch.uint8).reshape(E, N, K // 32)
        narrow |= {name + "_blocks", name + "_scales"}
    config = {**config, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    logger.info("export: %d gpt-oss experts tensors in MXFP4 (_blocks, _scales); attention, routers, embeddings "
                "and the head in the export's dtype", len(narrow) // 2)
    return out, config, narrow


class GptOssMxfp4:
    """A gpt-oss MXFP4 folder read as its weights: each `X_blocks` with `X_scales` as the experts tensor `X`
    (E, K, N), e2m1 x 2^(byte - 127) (a WeightSource over the folder); a rank's rows are its experts."""

    def __init__(self, folder, key: str):
        self.folder, self.path, self.config = folder, folder.path, folder.config
        self.packed = {n.removesuffix("_blocks"): n for n in folder.names() if n.endswith("_blocks")}
        for name, blocks in self.packed.items():
            shape, scales = folder.shape(blocks), name + "_scales"
            if (len(shape) != 4 or shape[-1] != 16 or scales not in folder.where
                    or tuple(folder.shape(scales)) != tuple(shape[:3])):
                raise UserError(f"{key} {folder.path}: {blocks!r} is {list(shape)}; accepted: gpt-oss MXFP4 blocks "
                                "(E, N, K/32, 16) with scales (E, N, K/32) beside them")
        self.hidden = set(self.packed.values()) | {n + "_scales" for n in self.packed}
        logger.info("%s: %s, gpt-oss MXFP4 (quant_method mxfp4): %d experts tensors dequantized as the format "
                    "defines (e2m1 x 2^(scale - 127))", key, folder.path, len(self.packed))

    def names(self) -> list[str]:
        return [n for n in self.folder.names() if n not in self.hidden] + list(self.packed)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.packed:
            return self.folder.shape(name)
        E, N, G, _ = self.folder.shape(self.packed[name])
        return E, G * 32, N

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.packed else self.folder.dtype(name)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        from mixprec.narrow.microscaling import decode_e2m1

        if name not in self.packed:
            return self.folder.read(name, rows)
        blocks = self.folder.read(self.packed[name], rows)  # (e, N, G, 16): this rank's experts only
        scales = _scale_values(self.folder.read(name + "_scales", rows).view(torch.uint8))
        e, N, G, _ = blocks.shape
        values = decode_e2m1(blocks.reshape(e * N * G, 16)).reshape(e, N, G, 32) * scales[..., None]
        return values.reshape(e, N, G * 32).transpose(1, 2)


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


class _ScaledWeights:
    """A folder's FP8 weights, each with its scale tensor beside it (`scales`: weight -> scale), read as the
    weights they stand for (a WeightSource over the folder); `hidden`: the folder's names that are not weights."""

    folder: object
    scales: dict[str, str]
    hidden: set[str]

    def names(self) -> list[str]:
        return [n for n in self.folder.names() if n not in self.hidden]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.folder.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.scales else self.folder.dtype(name)


class FineGrainedFP8(_ScaledWeights):
    """A folder's tensors as the weights they stand for: each `name` with a `name_scale_inv` beside it read
    as e4m3 x its block's scale."""

    def __init__(self, folder, key: str):
        self.folder, self.path, self.config = folder, folder.path, folder.config
        qc = folder.config["quantization_config"]
        block = qc.get("weight_block_size")
        self.scales = {n.removesuffix(SCALE): n for n in folder.names() if n.endswith(".weight" + SCALE)}
        self.hidden = set(self.scales.values()) | {n for n in folder.names()
                                                   if n.endswith((".input_scale", ".activation_scale"))}
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise UserError(f"{key} {folder.path}: quantization_config weight_block_size {block!r}; accepted: two "
                            "positive integers (e.g. [128, 128]) or null (one scale a tensor)")
        self.block = tuple(block) if block is not None else None
        for name, scale in self.scales.items():
            shape, grid = folder.shape(name), folder.shape(scale)
            want = tuple(math.ceil(n / b) for n, b in zip(shape, self.block)) if self.block else ()
            if tuple(grid) not in (want, (1,) * len(want)) or (not self.block and math.prod(grid) != 1):
                raise UserError(f"{key} {folder.path}: {scale!r} is {list(grid)} for a weight of {list(shape)}; "
                                f"accepted: one scale per {self.block} block ({list(want)})")
        logger.info("%s: %s, FineGrainedFP8 (quant_method fp8): %d weights in e4m3 with %s scales per %s block, "
                    "dequantized as the format defines (e4m3 x weight_scale_inv)", key, folder.path,
                    len(self.scales), self._scale_dtype(), "x".join(map(str, self.block or ("tensor",))))

    def _scale_dtype(self) -> str:
        dtypes = {str(self.folder.dtype(s)).removeprefix("torch.") for s in self.scales.values()}
        return "/".join(sorted(dtypes)) or "no"

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        if name not in self.scales:
            return self.folder.read(name, rows)
        q = self.folder.read(name, rows).float()
        if self.block is None:
            return q * _scale_values(self.folder.read(self.scales[name])).reshape(())
        scale = _block_scales(self.folder, self.scales[name], rows, q.shape, self.block)
        return q * _scale_values(scale)


def _block_scales(folder, name: str, rows: slice | None, shape, block) -> torch.Tensor:
    """The scales of tensor `name` (one per block of `block` elements, the last of a dimension partial) spread
    over the `shape` elements of `rows`: only those rows' blocks are read."""
    (br, bc), first = block, 0 if rows is None else rows.start
    grid = slice(first // br, math.ceil((first + shape[0]) / br))
    s = folder.read(name, grid)
    s = s.repeat_interleave(br, 0)[first - grid.start * br:][:shape[0]]
    return s.repeat_interleave(bc, 1)[:, :shape[1]]


class FloatQuantized(_ScaledWeights):
    """A compressed-tensors float-quantized folder (FP8 weights) read as its weights: each e4m3 `X.weight` times
    its `X.weight_scale` (per tensor, channel, group or block, as the config's weights say), the product in the
    scale's dtype, as the package's decompressor computes it."""

    def __init__(self, folder, key: str, weights: dict):
        self.folder, self.path, self.config = folder, folder.path, folder.config
        self.strategy = weights.get("strategy")
        if self.strategy not in ("tensor", "channel", "group", "block"):
            raise UserError(f"{key} {folder.path}: compressed-tensors float-quantized weights with strategy "
                            f"{self.strategy!r}; accepted: tensor, channel, group, block")
        self.block = ((1, weights.get("group_size")) if self.strategy == "group" else
                      tuple(weights.get("block_structure") or ()) if self.strategy == "block" else None)
        self.scales = {n: n + "_scale" for n in folder.names()
                       if folder.dtype(n) in (torch.float8_e4m3fn, torch.float8_e5m2) and n + "_scale" in folder.where}
        self.hidden = {s for s in self.scales.values()} | {n.removesuffix("weight") + "input_scale"
                                                           for n in self.scales}
        logger.info("%s: %s, compressed-tensors float-quantized (%s scales): %d weights in FP8, dequantized as its "
                    "decompressor computes them", key, folder.path, self.strategy, len(self.scales))

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        if name not in self.scales:
            return self.folder.read(name, rows)
        q = self.folder.read(name, rows)
        if self.strategy == "tensor":
            scale = self.folder.read(self.scales[name]).reshape(())
        elif self.strategy == "channel":
            scale = self.folder.read(self.scales[name], rows).reshape(-1, 1)
        else:
            scale = _block_scales(self.folder, self.scales[name], rows, q.shape, self.block)
        return (q.to(scale.dtype) * scale).float()


class CompressedTensors:
    """A compressed-tensors folder in nvfp4- or mxfp4-pack-quantized read as its weights: each `X.weight_packed`
    (with `X.weight_scale`, NVFP4's `X.weight_global_scale`) as `X.weight` (a WeightSource over the folder)."""

    def __init__(self, folder, key: str, fmt: str):
        self.folder, self.path, self.config = folder, folder.path, folder.config
        self.group, self.nv = COMPRESSED[fmt], fmt.startswith("nvfp4")
        self.packed = {n.removesuffix("_packed"): n.removesuffix(".weight_packed") for n in folder.names()
                       if n.endswith(".weight_packed")}
        self.hidden = {f"{base}.{part}" for base in self.packed.values()
                       for part in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}
        for name, base in self.packed.items():
            R, half = folder.shape(base + ".weight_packed")
            want = (R, 2 * half // self.group)
            if (folder.dtype(base + ".weight_packed") != torch.uint8 or 2 * half % self.group
                    or tuple(folder.shape(base + ".weight_scale")) != want):
                raise UserError(f"{key} {folder.path}: {base}.weight_packed {list(folder.shape(base + '.weight_packed'))}"
                                f" with weight_scale {list(folder.shape(base + '.weight_scale'))}; accepted: uint8 "
                                f"pairs of e2m1 codes and one scale per {self.group} elements ({list(want)})")
        logger.info("%s: %s, compressed-tensors %s: %d weights in e2m1, dequantized as its decompressor computes them",
                    key, folder.path, fmt, len(self.packed))

    def names(self) -> list[str]:
        return [n for n in self.folder.names() if n not in self.hidden] + list(self.packed)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.packed:
            return self.folder.shape(name)
        R, half = self.folder.shape(self.packed[name] + ".weight_packed")
        return R, 2 * half

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.packed else self.folder.dtype(name)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        from mixprec.narrow.microscaling import decode_e2m1

        if name not in self.packed:
            return self.folder.read(name, rows)
        base = self.packed[name]
        values = decode_e2m1(self.folder.read(base + ".weight_packed", rows))  # (rows, C) float32
        scale = self.folder.read(base + ".weight_scale", rows)
        if self.nv:  # the block scale over the global one, rounded once, as the decompressor divides
            scale = scale.float() / self.folder.read(base + ".weight_global_scale").float().reshape(())
        else:
            scale = _scale_values(scale)
        return values * scale.repeat_interleave(self.group, 1)


def _scale_values(s: torch.Tensor) -> torch.Tensor:
    """A scale tensor's values in float32: ue8m0 as float8_e8m0fnu, or its bytes (uint8) as 2^(byte - 127)."""
    if s.dtype == torch.uint8:
        return (s.float() - 127.0).exp2()
    return s.float()


def dequantized(folder, key: str):
    """The folder itself, or, with a quantization_config, a source reading its weights dequantized; a
    quant_method mixprec does not read is refused in one line."""
    qc = folder.config.get("quantization_config")
    if qc is None:
        return folder
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in READ:
        accepted = "; ".join(f"{m} ({what})" for m, what in READ.items())
        raise UserError(f"{key} {folder.path}: quantization_config quant_method {method!r} is not read; accepted: "
                        f"{accepted}, or a folder without quantization_config")
    if method == "mxfp4":
        return GptOssMxfp4(folder, key)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt == "float-quantized":
            groups = list((qc.get("config_groups") or {}).values())
            if len(groups) != 1 or not isinstance(groups[0].get("weights"), dict):
                raise UserError(f"{key} {folder.path}: compressed-tensors float-quantized with {len(groups)} "
                                "config groups; accepted: one, with its weights' quantization")
            return FloatQuantized(folder, key, groups[0]["weights"])
        if fmt not in COMPRESSED:
            raise UserError(f"{key} {folder.path}: compressed-tensors format {fmt!r} is not read; accepted: "
                            f"{', '.join((*COMPRESSED, 'float-quantized'))}")
        return CompressedTensors(folder, key, fmt)
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UserError(f"{key} {folder.path}: quantization_config fmt {qc.get('fmt')!r}; accepted: e4m3")
    return FineGrainedFP8(folder, key)
