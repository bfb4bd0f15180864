"""`mixprec export RUN_OR_CHECKPOINT OUT`: a run's weights as a Hugging Face folder that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads.

    export("outputs/run", "outputs/run-hf")                     # latest checkpoint, bfloat16
    export("outputs/run/checkpoint/step-20", out, dtype=torch.float32)

Reads the model tensors of a single-file or DCP checkpoint (never the optimizer state), maps
them with the architecture's adapter (mixprec's Llama becomes a LlamaForCausalLM, its
mixtures of experts a Glm4MoeForCausalLM, routers kept in float32; a transformers model keeps
its names), and writes config.json, safetensors (sharded above
`max_shard_bytes`, with an index) and the run's tokenizer.json. FP8 and MX runs keep
their high-precision weights (the converted Linear layers keep the original parameters):
those are exported, in `dtype`, or with `fmt` in a narrow format inference engines load
(mixprec.interop.quantized: "fp8-block", "nvfp4", "mxfp4": the decoder layers' Linears, and
each expert's projections as a Linear of its own (mixprec.interop.expert_files); embeddings,
norms, the head and routers in `dtype`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from mixprec.data.tokenizer import ByteTokenizer
from mixprec.dtypes import dtype_name
from mixprec.errors import UserError
from mixprec.interop import quantized
from mixprec.interop.adapters import adapter_for
from mixprec.interop.expert_files import is_fused, per_expert
from mixprec.interop.hf_folder import check_out, write_folder
from mixprec.interop.load import CheckpointWeights
from mixprec.models.ties import tied_names
from mixprec.narrow.experts import hf as hf_experts
from mixprec.runs.resolve import empty_model, resolve, tokenizer_file

logger = logging.getLogger(__name__)


def export(source: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16,
           max_shard_bytes: int = 5 << 30, fmt: str = "bf16") -> dict:
    """Write the Hugging Face folder; returns {"files", "bytes", "seconds", "step", "tokenizer"}."""
    t0 = time.perf_counter()
    check_out(out)  # before anything is read
    if fmt not in quantized.FORMATS:
        raise UserError(f"--format {fmt!r} is not known; accepted: {', '.join(quantized.FORMATS)}")
    kind, path, run = resolve(source)
    if kind == "hf":
        raise UserError(f"{source} is already a Hugging Face folder; accepted: a run folder or a "
                        "mixprec checkpoint")
    weights = CheckpointWeights(path, key="checkpoint")
    model = empty_model(weights.meta)  # on the meta device: its names, and which of them are ties
    adapter = adapter_for(model, weights.meta.get("hf_config"))
    config, tied = adapter.hf_config(dtype_name(dtype)), tied_names(model)
    tensors = {}
    for name, t in weights.tensors.items():
        if name in tied:  # stored once, under the name it is tied to
            continue
        try:
            tensors[adapter.hf_name(name)] = adapter.to_hf(name, t)
        except KeyError:
            raise UserError(f"{path} holds {name!r}, which the {config['architectures'][0]} "
                            "layout has no place for; accepted: a checkpoint written by mixprec train") from None
    tokenizer = tokenizer_file(run)
    if tokenizer is not None:
        text = tokenizer.read_text()
    elif weights.meta.get("tokenizer") == "byte":
        text, tokenizer = ByteTokenizer.tokenizer_json(), "UTF-8 bytes"
    else:
        text = None
        logger.info("export: no tokenizer.json (the run's tokenizer file is not where its config.toml says); the "
                    "folder holds the model only")
    # a mixture of experts' routers stay in float32 in the folder, as they trained (by role: hf_experts.routers)
    routers = tuple(f"{fqn}." for fqn in hf_experts.routers(model, hf_experts.find_experts(model)))
    float32 = {adapter.hf_name(n) for n in weights.tensors if n.startswith(routers) and n not in tied}
    convert, kept = _linears(model, adapter, routers, tied)
    if fmt != "bf16":  # a narrow format's experts one Linear each, as transformers and inference engines read them
        tensors, experts = per_expert(tensors, config.get("model_type", ""))
        convert.update(experts)
        fused = [n for n in tensors if is_fused(n)]
        if fused and not quantized.own_layout(fmt, config):
            logger.info("export: %d fused experts tensors (%s, ...) stay in %s: %s's experts have no per-expert "
                        "layout mixprec writes", len(fused), fused[0], dtype_name(dtype), config.get("model_type"))
    tensors, config, as_is = quantized.quantize_folder(tensors, config, convert, kept, fmt)
    written = write_folder(out, tensors, config, dtype=dtype, max_shard_bytes=max_shard_bytes,
                           extra_files={"tokenizer.json": text} if text else None, float32=float32, as_is=as_is)
    seconds = time.perf_counter() - t0
    logger.info("export: step %s of %s -> %s: %d tensors in %s%s, %d file(s), %.1f MB in %.1f s (%.0f MB/s)",
                weights.step, path, out, len(tensors), dtype_name(dtype), "" if fmt == "bf16" else f" and {fmt}",
                len(written["files"]),
                written["bytes"] / 1e6, seconds, written["bytes"] / 1e6 / seconds)
    return {**written, "seconds": seconds, "step": weights.step, "tokenizer": str(tokenizer) if tokenizer else None}


def _linears(model: torch.nn.Module, adapter, routers: tuple[str, ...], tied) -> tuple[dict[str, str], list[str]]:
    """The folder names of the decoder layers' Linear weights a narrow format converts (weight -> module), and
    of the modules it keeps (the head; the routers, Linear or not: never narrow)."""
    convert, kept = {}, []
    for fqn, m in model.named_modules():
        router = f"{fqn}." in routers
        if not (isinstance(m, torch.nn.Linear) or router) or f"{fqn}.weight" in tied:
            continue
        hf = adapter.hf_name(f"{fqn}.weight")
        if "layers." in fqn and not router:
            convert[hf] = hf.removesuffix(".weight")
        else:
            kept.append(hf.removesuffix(".weight"))
    return convert, kept
