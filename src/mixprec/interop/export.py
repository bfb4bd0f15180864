"""`mixprec export RUN_OR_CHECKPOINT OUT`: a run's weights as a Hugging Face folder that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads.

    export("outputs/run", "outputs/run-hf")                     # latest checkpoint, bfloat16
    export("outputs/run/checkpoint/step-20", out, dtype=torch.float32)

Reads the model tensors of a single-file or DCP checkpoint (never the optimizer state), maps
them with the architecture's adapter (mixprec's Llama becomes a LlamaForCausalLM; a
transformers model keeps its names), and writes config.json, safetensors (sharded above
`max_shard_bytes`, with an index) and the run's tokenizer.json. FP8 and MX runs keep
their high-precision weights (the converted Linear layers keep the original parameters):
those are exported.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from mixprec.data.tokenizer import ByteTokenizer
from mixprec.dtypes import dtype_name
from mixprec.errors import UserError
from mixprec.interop.adapters import HFAdapter, LlamaAdapter
from mixprec.interop.hf_folder import check_out, write_folder
from mixprec.interop.load import CheckpointWeights
from mixprec.interop.runs import resolve, tokenizer_file

logger = logging.getLogger(__name__)


def hf_model_config(meta: dict, dtype: torch.dtype) -> tuple[dict, object]:
    """(config.json's fields, adapter) of the model a checkpoint's meta describes."""
    if "hf_config" in meta:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = dict(meta["hf_config"])
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
        config["torch_dtype"] = dtype_name(dtype)
        tied = {"hf.lm_head.weight"} if config.get("tie_word_embeddings") else set()
        return config, HFAdapter(tied)
    from mixprec.models.llama import ModelArgs

    adapter = LlamaAdapter(ModelArgs.from_architecture(meta))
    return adapter.hf_config(dtype_name(dtype)), adapter


def export(source: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16,
           max_shard_bytes: int = 5 << 30) -> dict:
    """Write the Hugging Face folder; returns {"files", "bytes", "seconds", "step", "tokenizer"}."""
    t0 = time.perf_counter()
    check_out(out)  # before anything is read
    kind, path, run = resolve(source)
    if kind == "hf":
        raise UserError(f"{source} is already a Hugging Face folder; accepted: a run folder or a "
                        "mixprec checkpoint")
    weights = CheckpointWeights(path, key="checkpoint")
    config, adapter = hf_model_config(weights.meta, dtype)
    tensors = {}
    for name, t in weights.tensors.items():
        if adapter.tied(name):
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
    written = write_folder(out, tensors, config, dtype=dtype, max_shard_bytes=max_shard_bytes,
                           extra_files={"tokenizer.json": text} if text else None)
    seconds = time.perf_counter() - t0
    logger.info("export: step %s of %s -> %s: %d tensors in %s, %d file(s), %.1f MB in %.1f s (%.0f MB/s)",
                weights.step, path, out, len(tensors), dtype_name(dtype), len(written["files"]),
                written["bytes"] / 1e6, seconds, written["bytes"] / 1e6 / seconds)
    return {**written, "seconds": seconds, "step": weights.step, "tokenizer": str(tokenizer) if tokenizer else None}
