"""`mixprec serve-gap RUN`: what serving a run's model in a narrow format changes, measured on the run's own
validation data: the trained model's forward (its checkpoint's weights, FP32) against the forward an inference
engine computes from the exported folder (mixprec.interop.quantized), emulated exactly on any device.

    serve_gap("outputs/run", ["fp8-block", "nvfp4", "mxfp4"])   # {format: {"logprob_gap", "kl", "top1_changed",
                                                                #           "val_loss", "served_val_loss", ...}}

Served: the folder's weights as its readers dequantize them (mixprec's import, the same values transformers and
compressed-tensors compute); fp8-block also quantizes each converted Linear's input per token in 1 x 128 groups
(e4m3, scale amax / 448), as its dynamic activation scheme does on a GPU (the experts' inputs are left in FP32:
their GEMMs run inside the experts module); nvfp4 and mxfp4 are weight-only (A16). Per target token: the
absolute gap in log-probability, KL(trained || served) over the vocabulary, and whether the likeliest token
changed; each averaged over every token of the validation batches.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from mixprec.errors import UserError
from mixprec.interop.quantized import FORMATS

logger = logging.getLogger(__name__)

SERVED = tuple(f for f in FORMATS if f != "bf16")


def _activations_in_fp8(model: torch.nn.Module, folder: Path) -> int:
    """Forward pre-hooks quantizing the input of each Linear whose weight the folder holds in e4m3, per token
    in 1 x 128 groups (dequantized at once: the GEMM then reads e4m3 x scale). Returns how many."""
    from mixprec.interop.adapters import adapter_for
    from mixprec.interop.hf_folder import HFFolder
    from mixprec.narrow.formats.recipe import E4M3
    from mixprec.narrow.formats.scaling import quantize

    def hook(module, args):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1]).float()
        return (quantize(flat, E4M3, (1, 128))[0].dequantize().reshape(x.shape).to(x.dtype),)

    files, adapter = HFFolder(folder), adapter_for(model)
    narrow = {n for n in files.names() if files.dtype(n) == torch.float8_e4m3fn}
    hooked = 0
    for fqn, m in model.named_modules(remove_duplicate=True):
        try:
            name = adapter.hf_name(f"{fqn}.weight")
        except KeyError:  # a name the folder does not use (a transformers model's second name for its layers)
            continue
        if isinstance(m, torch.nn.Linear) and name in narrow:
            m.register_forward_pre_hook(hook)
            hooked += 1
    return hooked


@torch.no_grad()
def _compare(trained, served, batches) -> dict:
    gap = kl = changed = loss_t = loss_s = 0.0
    tokens = 0
    for x, y, _ in batches:
        lt = torch.log_softmax(trained(x).float(), dim=-1)
        ls = torch.log_softmax(served(x).float(), dim=-1)
        pt_y, ps_y = lt.gather(-1, y[..., None])[..., 0], ls.gather(-1, y[..., None])[..., 0]
        gap += float((pt_y - ps_y).abs().sum())
        kl += float((lt.exp() * (lt - ls)).sum(-1).clamp(min=0).sum())
        changed += float((lt.argmax(-1) != ls.argmax(-1)).sum())
        loss_t, loss_s = loss_t - float(pt_y.sum()), loss_s - float(ps_y.sum())
        tokens += y.numel()
    return {"logprob_gap": gap / tokens, "kl": kl / tokens, "top1_changed": changed / tokens,
            "val_loss": loss_t / tokens, "served_val_loss": loss_s / tokens, "tokens": tokens}


def serve_gap(run: str | Path, formats=SERVED, batches: int | None = None) -> dict:
    """{format: the gap's figures} for the latest checkpoint of the run folder `run`, on `batches` of its
    validation batches (default: the run's training.eval_batches)."""
    from mixprec.data.loader import val_batches
    from mixprec.runs.export import export
    from mixprec.runs.generate import load_model
    from mixprec.runs.resolve import _run_config, resolve
    from mixprec.train.build import load_tokens

    for fmt in formats:
        if fmt not in SERVED:
            raise UserError(f"--format {fmt!r} is not known; accepted: {', '.join(SERVED)}")
    kind, path, folder = resolve(run)
    if folder is None:
        raise UserError(f"{run}: not a run folder (config.toml and a checkpoint); accepted: a run folder, whose "
                        "validation data the gap is measured on")
    config = _run_config(folder)
    _, _, _, val_tokens = load_tokens(config.data, folder)
    t = config.training
    data = val_batches(val_tokens, t.seq_len, t.local_batch_size, batches or t.eval_batches)
    trained, _ = load_model(str(folder), torch.device("cpu"))
    out = {}
    for fmt in formats:
        with tempfile.TemporaryDirectory() as tmp:
            export(folder, Path(tmp) / fmt, dtype=torch.float32, fmt=fmt)
            served, _ = load_model(str(Path(tmp) / fmt), torch.device("cpu"))
            note = "weights only (A16)"
            if fmt == "fp8-block":
                note = f"{_activations_in_fp8(served, Path(tmp) / fmt)} Linears' inputs in e4m3, 1x128 groups"
            out[fmt] = {**_compare(trained, served, data), "served": note}
        logger.info("serve-gap %s: |d log p| %.4g, KL %.4g, top-1 changed %.2f%% over %d tokens (%s)", fmt,
                    out[fmt]["logprob_gap"], out[fmt]["kl"], 100 * out[fmt]["top1_changed"], out[fmt]["tokens"],
                    out[fmt]["served"])
    return out
