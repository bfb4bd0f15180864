"""`mixprec analyze`: the numerics experiments and the gradient census, as one report."""

from __future__ import annotations

import argparse as _argparse_module
import inspect
from pathlib import Path

import torch

from mixprec.analysis import numerics
from mixprec.demo import examples
from mixprec.errors import UserError
from mixprec.models.llama import build_model, model_args

VALUES = [70000.0, 65504.0, 448.0, 1.0, 0.125, 257.0, 1e-3, 1e-5, 1e-7, 1e-8]


def _batch(text_path: str | None, batch: int, seq_len: int) -> torch.Tensor:
    if text_path is None:
        text = inspect.getsource(_argparse_module)
    else:
        path = Path(text_path)
        if not path.is_file():
            raise UserError(f"--text {text_path!r} is not a file; accepted: a UTF-8 text file")
        text = path.read_text(encoding="utf-8", errors="replace")
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()  # byte tokens
    need = batch * (seq_len + 1)
    if data.numel() < need:
        raise UserError(f"--text has {data.numel()} bytes; the census batch needs {need} (--batch x --seq-len+1)")
    return data[:need].view(batch, seq_len + 1)


def analyze(flavor: str, text: str | None, batch: int, seq_len: int, loss_scale: float, init_std: float,
            out: Path) -> dict:
    tokens = _batch(text, batch, seq_len)
    model = build_model(model_args(flavor, 256), device="cpu", storage_dtype=torch.float32, seed=0)
    model(tokens[:, :-1], tokens[:, 1:]).backward()  # FP32 gradients: the reference magnitudes
    census = numerics.gradient_census(model, loss_scale)
    sizes = {n: p.numel() for n, p in model.named_parameters() if p.grad is not None}
    total = {fmt: {k: sum(census[n][fmt][k] * sizes[n] for n in census) / sum(sizes.values())
                   for k in ("overflow", "underflow", "subnormal")} for fmt in numerics.LOW}
    out.mkdir(parents=True, exist_ok=True)
    numerics.plot_census(model, loss_scale, out / "gradient_census.png")
    return {
        "range": numerics.range_table(VALUES),
        "accumulation": numerics.accumulation_table(0.01, [100, 1000, 10000]),
        "quantisation": {"std": init_std, **numerics.quantisation(init_std)},
        "reduction": examples(),
        "census": census,
        "census_total": total,
        "census_setup": {"flavor": flavor, "batch": batch, "seq_len": seq_len, "loss_scale": loss_scale,
                         "plot": str(out / "gradient_census.png")},
    }


def format_analysis(r: dict) -> str:
    lines = ["values cast to each format (stored value, what happened):"]
    for row in r["range"]:
        cells = "  ".join(f"{f}: {row[f]['stored']:.6g} {row[f]['kind']}" for f in numerics.LOW)
        lines.append(f"  {row['value']:<9g} {cells}")
    lines.append("0.01 added N times (relative error of the sum):")
    for row in r["accumulation"]:
        lines.append(f"  N={row['n']:<6} " + "  ".join(f"{k}: {row[k]['sum']:.6g} ({row[k]['relative_error']:.1e})"
                                                     for k in ("fp32", "bf16", "fp16")))
    q = r["quantisation"]
    lines.append(f"Normal(0, {q['std']:g}) weights cast (SQNR dB, share flushed to zero):")
    lines.append("  " + "  ".join(f"{f}: {q[f]['sqnr_db']:.1f} dB, {q[f]['underflow']:.2%}" for f in numerics.LOW))
    lines.append("gradients summed across ranks in order, bfloat16 against float32 (the claim: BF16 reductions lose "
                 "small contributions):")
    for ex in r["reduction"]:
        lines.append(f"  {ex['case']:<38} bfloat16 {ex['bfloat16']:.6g}  float32 {ex['float32']:.6g}  "
                     f"exact {ex['exact']:.6g}")
    s = r["census_setup"]
    lines.append(f"gradient census, {s['flavor']} flavor, one step of {s['batch']} x {s['seq_len']} tokens, "
                 f"loss scale {s['loss_scale']:g} (all parameters; per layer in --json):")
    for fmt, v in r["census_total"].items():
        lines.append(f"  {fmt:<9} overflow {v['overflow']:.4%}  flushed to zero {v['underflow']:.4%}  "
                     f"subnormal {v['subnormal']:.4%}")
    lines.append(f"histogram: {s['plot']}")
    return "\n".join(lines)
