"""Narrow formats that inference engines load, in a Hugging Face folder: written by `mixprec export --format`,
read back as the weights they stand for by every loader of a folder (checkpoint.initial_load, generate,
load_model). One module a family of formats, each with its writer and its reader:

    fine_grained   fp8-block: transformers' FineGrainedFP8, vLLM's block FP8 (quant_method "fp8")
    compressed     nvfp4, mxfp4 (and float-quantized FP8, read): compressed-tensors' layouts
    gpt_oss        mxfp4 of a gpt-oss model: the family's _blocks / _scales (quant_method "mxfp4")

    tensors, config, as_is = quantize_folder(tensors, config, linears, kept, "fp8-block")    # export
    source = dequantized(folder, key)       # a folder with a quantization_config, as its dequantized weights

Any other quantization_config is refused in one line.
"""

from __future__ import annotations

import torch

from mixprec.errors import UserError
from mixprec.interop.quantized import compressed, fine_grained, gpt_oss
from mixprec.interop.quantized.compressed import COMPRESSED, CompressedTensors, FloatQuantized
from mixprec.interop.quantized.fine_grained import FineGrainedFP8
from mixprec.interop.quantized.gpt_oss import GptOssMxfp4, own_layout

__all__ = ["FORMATS", "READ", "quantize_folder", "dequantized", "own_layout", "FineGrainedFP8", "CompressedTensors",
           "FloatQuantized", "GptOssMxfp4"]

FORMATS = ("bf16", "fp8-block", "nvfp4", "mxfp4")  # mixprec export --format: the export dtype as it is, or a narrow one
READ = {"fp8": "FineGrainedFP8 (e4m3 weights, weight_scale_inv per block)",  # quant_method -> what is read
        "compressed-tensors": "formats nvfp4-pack-quantized, mxfp4-pack-quantized, float-quantized",
        "mxfp4": "gpt-oss's MXFP4 experts (_blocks, _scales)"}


def quantize_folder(tensors: dict[str, torch.Tensor], config: dict, linears: dict[str, str], kept: list[str],
                    fmt: str) -> tuple[dict[str, torch.Tensor], dict, set[str]]:
    """(tensors, config.json, the names written as they are) in `fmt`: each of `linears` (folder name of a
    Linear's weight -> the Linear's folder name) converted where the format takes its shape; the Linears `kept`
    (the head, routers) and the others named as left out (modules_to_not_convert, or compressed-tensors' ignore).
    `fmt` one of FORMATS (export checks it before it reads anything)."""
    if fmt == "bf16":
        return tensors, config, set()
    if own_layout(fmt, config):
        return gpt_oss.write(tensors, config)
    if fmt in compressed.PACKED:
        return compressed.write(tensors, config, linears, list(kept), fmt)
    return fine_grained.write(tensors, config, linears, list(kept))


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
