"""Micikevicius et al. 2018 ("Mixed Precision Training"), reproduced on a small Llama:
FP16 gradients below 2^-24 flush to zero without loss scaling; the loss scaler brings
them back and training matches FP32.

Gradients here are naturally tiny: the loss is a mean over batch x seq_len tokens, so
d(loss)/d(logit) is at most 1/(tokens) and the activation gradients below it smaller
still. The script prints, on one batch and the same weights:
- the share of activation-gradient elements under FP16's smallest subnormal (2^-24)
  and smallest normal (2^-14), measured in FP32;
- the share of nonzero FP32 weight-gradient elements that come out zero under FP16
  autocast without scaling, and with a 65536 loss scale;
then trains the same model in fp32, fp16 without loss scaling, and fp16-mixed (dynamic
loss scaling) and prints the validation losses. It writes a histogram of log2 |grad|
against FP16's range (the paper's figure 3).

    python benchmarks/fp16_underflow.py --steps 150 --out outputs/fp16_underflow
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from mixprec import LossScaleConfig, Policy, build_model, model_args
from mixprec.data.corpus import load_corpus
from mixprec.data.loader import TrainLoader, val_batches
from mixprec.data.tokenizer import ByteTokenizer
from mixprec.precision.emulation import EmulatedMatmul

FP16_SUBNORMAL, FP16_NORMAL = 2.0**-24, 2.0**-14


def make_model(seed: int = 0):
    args = model_args("debug", 256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2)
    return build_model(args, device="cpu", storage_dtype=torch.float32, seed=seed)


def activation_grads(model, x, y, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """d loss / d output of every Linear layer, as computed in `dtype` (divided by the scale)."""
    grads = []
    hooks = [m.register_full_backward_hook(lambda m, gi, go: grads.append(go[0].detach().flatten()))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with EmulatedMatmul():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x, y)
        (loss * scale).backward()
    for h in hooks:
        h.remove()
    model.zero_grad()
    return torch.cat([g.float() / scale for g in grads])


def weight_grads(model, x, y, dtype, scale: float) -> list[torch.Tensor]:
    # FP16 GEMMs emulated in FP32 with FP16 operands and results: a GPU tensor core's numerics.
    with EmulatedMatmul():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x, y)
        (loss * scale).backward()
    grads = [p.grad.detach().clone() / scale for p in model.parameters()]
    model.zero_grad()
    return grads


def flushed_share(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    nonzero = sum(int((r != 0).sum()) for r in ref)
    lost = sum(int(((r != 0) & (g == 0)).sum()) for r, g in zip(ref, got))
    return lost / nonzero


def rel_error(ref, got) -> float:
    num = sum(float((r - g).pow(2).sum()) for r, g in zip(ref, got))
    return math.sqrt(num / sum(float(r.pow(2).sum()) for r in ref))


def train(policy: Policy, loader_state, tokens, val, steps: int) -> dict:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model, opt = policy.setup(model, opt)
    loader = TrainLoader(tokens, *loader_state)
    losses = []
    for _ in range(steps):
        x, y = loader.next_batch()
        with policy.autocast():
            loss = model(x, y)
        policy.backward(loss)
        policy.step(opt, max_norm=1.0)
        losses.append(loss.item())
    with torch.no_grad(), policy.autocast():
        val_loss = sum(model(x, y).item() for x, y, _ in val) / len(val)
    stats = policy.summary()
    return {"val_loss": val_loss, "train_loss_last10": sum(losses[-10:]) / 10, "skipped": stats["skipped_steps"],
            "loss_scale": stats["loss_scale"], "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default="outputs/fp16_underflow")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus("stdlib", 0.05)
    tok = ByteTokenizer()
    tokens = tok.encode(corpus.train)
    val = val_batches(tok.encode(corpus.val), args.seq_len, args.batch, 4)
    loader_state = (args.seq_len, args.batch, 0)
    x, y = TrainLoader(tokens, *loader_state).next_batch()

    model = make_model()
    acts = activation_grads(model, x, y)
    nonzero = acts.abs()[acts != 0]
    print(f"one batch of {args.batch}x{args.seq_len} tokens, {sum(p.numel() for p in model.parameters())} parameters")
    print(f"activation gradients below FP16's smallest subnormal 2^-24 (flush to zero): "
          f"{float((nonzero < FP16_SUBNORMAL).float().mean()):.1%}")
    print(f"activation gradients below FP16's smallest normal 2^-14 (subnormal, precision lost): "
          f"{float((nonzero < FP16_NORMAL).float().mean()):.1%}")
    ref = weight_grads(model, x, y, torch.float32, 1.0)
    figures = {}
    for name, scale in (("fp16, no loss scaling", 1.0), ("fp16, loss scale 65536", 65536.0)):
        act16 = activation_grads(model, x, y, torch.float16, scale)
        got = weight_grads(model, x, y, torch.float16, scale)
        figures[name] = {"activation_flushed": flushed_share([acts], [act16]),
                         "weight_flushed": flushed_share(ref, got), "weight_rel_error": rel_error(ref, got)}
        f = figures[name]
        print(f"{name:<24} activation gradients flushed to zero: {f['activation_flushed']:.2%}; weight gradients "
              f"flushed: {f['weight_flushed']:.3%}, relative error vs fp32: {f['weight_rel_error']:.2e}")
    plot(nonzero, out / "grad_histogram.png")

    modes = {
        "fp32": Policy.from_preset("fp32"),
        # fp16-mixed with the scale pinned at 1 is fp16 autocast without loss scaling
        "fp16, no loss scaling": Policy.from_preset(
            "fp16-mixed", loss_scale=LossScaleConfig(init_scale=1.0, min_scale=1.0, max_scale=1.0,
                                                     fallback_after=0, fallback_to="fp32")),
        "fp16-mixed (dynamic)": Policy.from_preset("fp16-mixed", loss_scale=LossScaleConfig(fallback_after=0)),
    }
    results = {}
    print(f"\ntraining {args.steps} steps per mode")
    for name, policy in modes.items():
        results[name] = train(policy, loader_state, tokens, val, args.steps)
        r = results[name]
        print(f"{name:<24} val loss {r['val_loss']:.4f}  last-10 train loss {r['train_loss_last10']:.4f}  "
              f"skipped {r['skipped']}  final scale {r['loss_scale']}", flush=True)
    base = results["fp32"]["val_loss"]
    for name, r in results.items():
        print(f"{name:<24} val loss relative to fp32: {(r['val_loss'] - base) / base:+.2%}")
    (out / "results.json").write_text(json.dumps({"one_batch": figures, "training": {
        k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in results.items()}}, indent=2))


def plot(magnitudes: torch.Tensor, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist(magnitudes.log2().numpy(), bins=120, color="tab:blue", alpha=0.8)
    ax.axvline(-24, color="red", label="FP16 smallest subnormal 2^-24")
    ax.axvline(-14, color="orange", label="FP16 smallest normal 2^-14")
    ax.axvline(math.log2(65504), color="black", label="FP16 max 65504")
    ax.set_yscale("log")
    ax.set_xlabel("log2 |activation gradient| (fp32 run)")
    ax.set_ylabel("elements")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
