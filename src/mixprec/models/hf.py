"""A Hugging Face causal language model from a local config.json, randomly initialised
(nothing is downloaded), behind the interface the trainer calls: `model(tokens, targets)`
returns the mean cross-entropy (on FP32 logits, as mixprec's own model computes it),
`layers` are the decoder layers, `num_params` and `flops_per_token` feed the metrics.

    config = load_hf_config("path/to/config.json")     # or the folder that holds it
    model = HFCausalLM(config)

`transformers` is the optional extra `mixprec[hf]`, imported here only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from mixprec.errors import UserError


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("model.hf_config needs the transformers package; accepted: pip install 'mixprec[hf]', or "
                        "leave model.hf_config empty for mixprec's own Llama") from None
    return transformers


def load_hf_config(path: str):
    """The transformers config of a causal LM from `path` (a config.json or its folder);
    one clear error for a missing file, bad JSON, or a model that is not a causal LM."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise UserError(f"model.hf_config: no file {str(file)!r}; accepted: a Hugging Face config.json, or the "
                        "folder that holds one")
    try:
        fields = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"model.hf_config: {file} is not JSON ({e}); accepted: a Hugging Face config.json") from None
    return hf_config_from_dict(fields, f"model.hf_config: {file}")


def hf_config_from_dict(fields: dict, where: str):
    """The transformers config of a causal LM from config.json's fields (a checkpoint records them)."""
    transformers = _transformers()
    fields = dict(fields) if isinstance(fields, dict) else {}
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise UserError(f"{where} has no model_type; accepted: a Hugging Face config.json "
                        "(model_type llama, gpt2, qwen2, mistral, ...)")
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as e:
        raise UserError(f"{where}: model_type {model_type!r} is unknown to transformers "
                        f"{transformers.__version__} ({str(e).splitlines()[0][:120]})") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{where}: model_type {model_type!r} is not a causal language model; accepted: a "
                        "decoder with an LM head (llama, gpt2, qwen2, mistral, gemma, phi3, ...)")
    return config


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The longest nn.ModuleList of the model: its decoder layers (model.layers, transformer.h, ...)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise UserError(f"{type(model).__name__} has no nn.ModuleList of layers (its decoder layers) to shard or wrap")
    return max(lists, key=len)


class HFCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hf = _transformers().AutoModelForCausalLM.from_config(config)
        self.config = config
        self.layers = decoder_layers(self.hf)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # transformers' own rule where it checkpoints layers itself: no key/value cache (a layer recomputed in
        # backward appended to it again on transformers 5.0 to 5.8 at least: other shapes than its forward saved)
        recomputes = any(getattr(layer, "mixprec_recomputes", False) for layer in self.layers)
        logits = self.hf(input_ids=tokens, **({"use_cache": False} if recomputes else {})).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self, exclude_embedding: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embedding:
            for m in self.modules():
                if isinstance(m, nn.Embedding):
                    params.pop(id(m.weight), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: int) -> int:
        """6 per non-embedding parameter plus attention's score and value products."""
        c = self.config
        hidden = getattr(c, "hidden_size", None) or c.n_embd
        return 6 * self.num_params(exclude_embedding=True) + 12 * len(self.layers) * hidden * seq_len


def meta_of(config) -> dict:
    """What a checkpoint must match: the config's architecture fields."""
    skip = {"transformers_version", "torch_dtype", "dtype", "_name_or_path", "architectures"}
    return {k: v for k, v in config.to_dict().items() if k not in skip}


def max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
