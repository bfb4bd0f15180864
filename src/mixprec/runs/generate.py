"""`mixprec generate RUN_OR_FOLDER --prompt TEXT`: what a model writes, sampled token by token
(no KV cache: each token re-runs the window, nanoGPT's `sample.py`), in FP32 on the CPU or the
first GPU.

    model, tokenizer = load_model("outputs/run")      # a run, a checkpoint or a Hugging Face folder
    text = generate(model, tokenizer, "def main(", max_new_tokens=100, temperature=0.8, top_k=50)
"""

from __future__ import annotations

import logging

import torch

from mixprec.data.tokenizer import ByteTokenizer, load_tokenizer_file
from mixprec.errors import UserError
from mixprec.interop.adapters import llama_fields
from mixprec.interop.hf_folder import HFFolder
from mixprec.interop.load import CheckpointWeights, OwnNames, load_weights, materialize, open_source
from mixprec.models.llama import ModelArgs
from mixprec.runs.resolve import empty_model, resolve, tokenizer_file

logger = logging.getLogger(__name__)


def load_model(path: str, device: torch.device | None = None):
    """(model in FP32 evaluation mode, tokenizer) of a run folder, checkpoint or Hugging Face folder."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, p, run = resolve(path)
    if kind == "hf":
        config = HFFolder(p, key="folder").config
        try:
            model = empty_model(ModelArgs(**llama_fields(config, "folder")).architecture())
        except UserError:  # not a Llama mixprec's own computes: run it as the transformers model
            model = empty_model({"hf_config": config})
        source, adapter = open_source(p, model, key="folder")  # narrow formats dequantized, experts merged
        file = p / "tokenizer.json"
    else:
        source = CheckpointWeights(p, key="folder")
        model, adapter, file = empty_model(source.meta), OwnNames(), tokenizer_file(run)
    materialize(model.float(), device)
    load_weights(model, source, adapter, key="folder")
    if file is not None and file.is_file():
        tokenizer = load_tokenizer_file(file)
    elif kind == "checkpoint" and source.meta.get("tokenizer") == "byte":
        tokenizer = ByteTokenizer()
    else:
        raise UserError(f"no tokenizer.json for {path}; accepted: a run folder (its tokenizer is "
                        "found from its config.toml) or a Hugging Face folder with tokenizer.json")
    return model.eval(), tokenizer


@torch.no_grad()
def generate(model, tokenizer, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8,
             top_k: int = 50, seed: int = 0) -> str:
    """The prompt's continuation: temperature 0 takes the likeliest token; otherwise sample from
    the `top_k` likeliest (0: all) at `temperature`."""
    device = next(model.parameters()).device
    window = getattr(getattr(model, "args", None), "max_seq_len", None) or 1024
    tokens = tokenizer.encode(prompt).tolist()
    if not tokens:
        raise UserError("--prompt is empty after tokenizing; accepted: some text")
    generator = torch.Generator(device=device).manual_seed(seed)
    new = []
    for _ in range(max_new_tokens):
        context = torch.tensor([(tokens + new)[-window:]], device=device)
        logits = model(context)[0, -1].float()  # (V,)
        if temperature == 0:
            new.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        new.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return tokenizer.decode(new)
