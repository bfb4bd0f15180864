"""A saved optimizer state's moments, whatever format they were saved in: which format that is, and the state
made fit for the optimizer loading it (mixprec's AdamW in another moment format, or an optimizer of dense moments
of its own such as torch's AdamW): refused in one line, or converted where the run asks
(checkpoint.convert_optimizer_states: dequantized to FP32, then stored in the loading format)."""

from __future__ import annotations

import logging

import torch

from mixprec.errors import UserError
from mixprec.optim.state_formats import SCALE, StateFormat, dequantize, quantize, scale_shape
from mixprec.shards import local_shard, shaped_as

logger = logging.getLogger(__name__)

BLOCK = "moments_block"  # the state key of a quantized format's block size (an int)
MOMENTS = {"exp_avg": True, "exp_avg_sq": False}  # key -> signed code


def saved_format(saved: dict) -> str:
    """The moment format of one parameter's saved state: 8bit, fp8, or a dense dtype's name."""
    m = saved.get("exp_avg")
    if not torch.is_tensor(m):
        return "none"
    if "exp_avg" + SCALE in saved:
        return f"{'8bit' if m.dtype == torch.uint8 else 'fp8'} (blocks of {saved.get(BLOCK)})"
    return StateFormat.of(m.dtype).name if m.dtype in (torch.float32, torch.bfloat16, torch.float16) else str(m.dtype)


def _dequantized(entry: dict) -> dict:
    """One parameter's saved state with its quantized moments as FP32 (placed as their codes were); a state of
    dense moments as it is."""
    if "exp_avg" + SCALE not in entry:
        return entry
    out = dict(entry)
    block = int(out.pop(BLOCK))
    for key, signed in MOMENTS.items():
        codes, scales = out[key], out.pop(key + SCALE)
        out[key] = shaped_as(codes, dequantize(local_shard(codes), local_shard(scales), block, signed), codes.shape)
    return out


def _converted(p: torch.Tensor, entry: dict, fmt: StateFormat) -> dict:
    """`entry`'s moments dequantized to FP32 and stored in `fmt`, p's format."""
    out = _dequantized(entry)
    for key, signed in MOMENTS.items():
        value = local_shard(out[key]).float()
        if fmt.quantized:
            codes, scales = quantize(value, fmt.name, fmt.block_size, signed)
            out[key], out[key + SCALE] = shaped_as(p, codes, p.shape), shaped_as(
                p, scales, scale_shape(p.shape, fmt.block_size))
            out[BLOCK] = fmt.block_size
        else:
            out[key] = shaped_as(p, value.to(fmt.dtype), p.shape)
    return out


def in_formats(params: list, saved: dict, format_of, convert: bool) -> dict:
    """The saved per-parameter states (index -> entry) each in its parameter's format (format_of(p)): as they
    are where the formats agree; else refused in one line, or converted where `convert`."""
    saved = {k: dict(v) for k, v in saved.items()}
    for index, entry in saved.items():
        p = params[index] if isinstance(index, int) and index < len(params) else None
        if p is None:
            continue
        have, want = saved_format(entry), format_of(p).label
        if have in ("none", want):
            continue
        if not convert:
            raise UserError(f"optimizer state: saved with {have} moments, this run keeps {want} moments "
                            f"(precision.optimizer_states); accepted: the saved format, or "
                            "checkpoint.convert_optimizer_states true to convert")
        saved[index] = _converted(p, entry, format_of(p))
    return saved


def for_dense_optimizer(optimizer: torch.optim.Optimizer, state_dict: dict, convert: bool) -> dict:
    """A saved optimizer state made fit for an optimizer that keeps dense moments of its own (torch's
    AdamW: it would load 8-bit codes as moments, values up to 255, with a warning at most). Saved
    quantized moments are refused in one line, or, `convert`, dequantized to FP32 (the optimizer's own
    load casts them to its parameters' dtype). mixprec's AdamW checks its own (AdamW.load_state_dict,
    `in_formats`): the caller passes it its state as it is."""
    quantized = [e for e in state_dict.get("state", {}).values() if "exp_avg" + SCALE in e]
    if not quantized:
        return state_dict
    if not convert:
        raise UserError(f"optimizer state: saved with {saved_format(quantized[0])} moments, this run's "
                        f"{type(optimizer).__name__} keeps dense moments; accepted: the saved moments "
                        "(precision.optimizer_states), or checkpoint.convert_optimizer_states true to convert")
    state = {index: _dequantized(entry) for index, entry in state_dict["state"].items()}
    logger.info("optimizer: the checkpoint's %s moments dequantized for %s (checkpoint.convert_optimizer_states)",
                saved_format(quantized[0]), type(optimizer).__name__)
    return {**state_dict, "state": state}
