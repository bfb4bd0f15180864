"""mixprec's own mixture of experts (`--model.flavor moe-debug` by default) trained in each
preset for several seeds on a real corpus (this Python's standard library, byte tokens), and
judged against bf16-mixed seed by seed:

- the final validation loss (mean and range over the seeds of each preset's gap to bf16-mixed);
- routing: on the first validation windows, the share of each token's top-k experts, per MoE
  block, that the preset's trained model picks as bf16-mixed's trained model of the same seed
  does (1.0: the same experts everywhere; chance: k / E), and the same share for bf16-mixed's
  trained weights computing in the preset (the recipe's own effect on the router's choices);
- load balance: max / mean rows per expert on those windows (the worst block; 1.0: even), and
  the last training step's router_load.

    python benchmarks/moe_flavor_accuracy.py --out runs/moe-flavor [--flavor moe-debug] [--steps 200]
        [--presets bf16-mixed,fp8-rowwise,...] [--seeds 0,1,2]

Each run is `mixprec train` in a process of its own (skipped when its summary.json exists); the
table and a plot (moe_flavor_accuracy.png) follow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

PRESETS = "bf16-mixed,fp8-tensorwise,fp8-rowwise,fp8-blockwise,mxfp8,nvfp4,mxfp4"


def train(run: Path, flavor: str, preset: str, seed: str, steps: int) -> None:
    if (run / "summary.json").is_file():
        return
    here = Path(__file__).resolve().parent
    subprocess.run([sys.executable, "-m", "mixprec", "train", "--config", str(here.parent / "configs" / "debug.toml"),
                    "--model.flavor", flavor, "--precision.preset", preset, "--training.steps", str(steps),
                    "--training.warmup_steps", str(steps // 10), "--training.eval_interval", str(steps),
                    "--training.eval_batches", "8", "--training.seed", seed, "--checkpoint.interval", str(steps),
                    "--checkpoint.keep_latest_k", "1", "--metrics.progress_bar", "false", "--metrics.log_freq",
                    str(steps // 4), "--job.dump_folder", str(run)], check=True)


def routing(run: Path, tokens: torch.Tensor, preset: str | None = None) -> list[torch.Tensor]:
    """Each MoE block's top-k expert ids (N, k) for `tokens`, by the run's trained model: in FP32, or
    computing in `preset` (its layout applied to the loaded weights, under its autocast)."""
    from mixprec.models.moe import Router
    from mixprec.precision import Policy
    from mixprec.runs.generate import load_model

    model, _ = load_model(str(run), torch.device("cpu"))
    policy = Policy.from_preset(preset) if preset else None
    if policy is not None:
        policy.prepare_model(model, "cpu")
    chosen = []
    hooks = [m.register_forward_hook(lambda m, a, out: chosen.append(out[1])) for m in model.modules()
             if isinstance(m, Router)]
    with torch.no_grad(), policy.autocast() if policy is not None else contextlib.nullcontext():
        model(tokens)
    for h in hooks:
        h.remove()
    return chosen


def overlap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The share of (token, block) top-k slots where both runs picked the same expert."""
    same = total = 0
    for x, y in zip(a, b):
        E = int(max(x.max(), y.max())) + 1
        hx = torch.zeros(x.shape[0], E).scatter_(1, x, 1.0)
        hy = torch.zeros(y.shape[0], E).scatter_(1, y, 1.0)
        same += float((hx * hy).sum())
        total += x.numel()
    return same / total


def balance(chosen: list[torch.Tensor]) -> float:
    """The worst block's max / mean rows per expert."""
    worst = 0.0
    for x in chosen:
        counts = torch.bincount(x.flatten()).float()
        worst = max(worst, float(counts.max() / counts.mean()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--flavor", default="moe-debug")
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--windows", type=int, default=16, help="validation windows of 64 tokens for routing")
    args = parser.parse_args()
    from mixprec.data.corpus import load_corpus
    from mixprec.data.tokenizer import ByteTokenizer

    presets, seeds, out = args.presets.split(","), args.seeds.split(","), Path(args.out)
    if presets[0] != "bf16-mixed":
        sys.exit("--presets: accepted: bf16-mixed first (the reference)")
    n = len(presets) * len(seeds)
    for i, (seed, preset) in enumerate((s, p) for s in seeds for p in presets):
        print(f"[{i + 1}/{n}] {args.flavor} {preset} seed {seed}", flush=True)
        train(out / f"seed{seed}" / preset, args.flavor, preset, seed, args.steps)
    val = ByteTokenizer().encode(load_corpus("stdlib", 0.05).val)
    tokens = val[: args.windows * 64].view(args.windows, 64)
    rows = {p: {"gap": [], "overlap": [], "same_weights": [], "balance": [], "router_load": []} for p in presets}
    for seed in seeds:
        ref = routing(out / f"seed{seed}" / "bf16-mixed", tokens)
        ref_mixed = routing(out / f"seed{seed}" / "bf16-mixed", tokens, "bf16-mixed")
        base = json.loads((out / f"seed{seed}" / "bf16-mixed" / "summary.json").read_text())["final_val_loss"]
        for p in presets:
            run = out / f"seed{seed}" / p
            summary = json.loads((run / "summary.json").read_text())
            records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            chosen = routing(run, tokens)
            rows[p]["gap"].append(100 * (summary["final_val_loss"] / base - 1))
            rows[p]["overlap"].append(overlap(chosen, ref))
            # bf16-mixed's trained weights computing in this preset: the recipe's own effect on the choices
            rows[p]["same_weights"].append(overlap(routing(out / f"seed{seed}" / "bf16-mixed", tokens, p), ref_mixed))
            rows[p]["balance"].append(balance(chosen))
            rows[p]["router_load"].append(records[-1]["router_load"])
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"\n{args.flavor}, {args.steps} steps of 8 x 64 byte tokens, seeds {','.join(seeds)}, CPU {cap}; each figure "
          "the mean over the seeds (range in brackets)")
    print("| preset | val loss vs bf16-mixed | same top-k as bf16-mixed: trained apart | same weights | "
          "load max/mean (validation) | router_load (last step) |")
    print("|---|---:|---:|---:|---:|---:|")
    for p in presets:
        r = rows[p]
        fmt = lambda v, f: f"{statistics.mean(v):{f}} ({min(v):{f}} .. {max(v):{f}})"  # noqa: E731
        print(f"| {p} | {fmt(r['gap'], '+.2f')}% | {fmt(r['overlap'], '.3f')} | {fmt(r['same_weights'], '.3f')} | "
              f"{fmt(r['balance'], '.2f')} | {fmt(r['router_load'], '.2f')} |")
    (out / "moe_flavor_accuracy.json").write_text(json.dumps(rows, indent=1))
    from mixprec.reporting import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("gap", "overlap", "balance"), ("val loss vs bf16-mixed (%)",
                                                                    "same top-k as bf16-mixed: trained apart (dots), "
                                                                    "same weights (squares)",
                                                                    "load max/mean (validation)")):
        for i, p in enumerate(presets):
            ax.plot([i] * len(seeds), rows[p][key], "o", color=f"C{i}")
            ax.plot([i - 0.2, i + 0.2], [statistics.mean(rows[p][key])] * 2, "-", color=f"C{i}")
            if key == "overlap":  # bf16-mixed's weights computing in the preset: hollow squares
                ax.plot([i + 0.15] * len(seeds), rows[p]["same_weights"], "s", mfc="none", color=f"C{i}")
        ax.set_xticks(range(len(presets)), presets, rotation=45, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"{args.flavor}: {args.steps} steps, seeds {','.join(seeds)} (dots), means (bars); CPU {cap}")
    fig.tight_layout()
    fig.savefig(out / "moe_flavor_accuracy.png", dpi=120)
    print(f"plot: {out / 'moe_flavor_accuracy.png'}")


if __name__ == "__main__":
    main()
