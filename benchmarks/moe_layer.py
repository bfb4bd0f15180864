"""One mixture-of-experts layer (transformers' Qwen3-MoE block: router, experts, combine),
forward and backward, in each recipe against bf16-mixed (its experts on torch's grouped
GEMM in bfloat16), side by side in one process.

    python benchmarks/moe_layer.py                        # CPU-sized: H 512, I 256, 16 experts, top-4
    python benchmarks/moe_layer.py --hidden 2048 --intermediate 768 --experts 128 --top-k 8 \\
        --tokens 16384 --device cuda --compile            # Qwen3-30B-A3B's layer shape, on a GPU

Prints, per preset: milliseconds per forward+backward (median of --iters after --warmup),
the ratio to bf16-mixed, the peak memory of a step (CUDA), and the experts' route as the
conversion logged it.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

PRESETS = "bf16-mixed,fp8-tensorwise,fp8-rowwise,fp8-blockwise,mxfp8,nvfp4,mxfp4"


def layer(args, device: str):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                                  num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(config).to(device)
    for p in block.parameters():  # transformers leaves the experts to _init_weights
        torch.nn.init.normal_(p, std=0.02)
    return block


def run(args, preset: str, device: str) -> dict:
    from mixprec.precision import Policy

    block = layer(args, device)
    policy = Policy.from_preset(preset)
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("mixprec")
    level, log.level = log.level, logging.INFO
    log.addHandler(handler)
    try:
        policy.setup(block, torch.optim.AdamW(block.parameters(), lr=1e-3))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    line = next((s for s in said if "experts modules in" in s), "")
    # "... experts modules in FP8, each expert scaled on its own (ROUTE (one device-to-host read ...); ...)"
    route = line.split("scaled on its own (", 1)[1].split(" (")[0] if line else "bfloat16 on torch's grouped GEMM"
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)).to(device)

    def step():
        with policy.autocast(device):
            out = block(x.unsqueeze(0))
        out.float().square().mean().backward()
        for p in block.parameters():
            p.grad = None

    fn = torch.compile(step) if args.compile else step
    times = []
    for i in range(args.warmup + args.iters):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return {"preset": preset, "ms": 1e3 * statistics.median(times), "peak_gib": peak, "route": route.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    from mixprec.narrow.gemm.fp8 import cpu_name

    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({cpu_name()})"
    print(f"# MoE layer H {args.hidden}, I {args.intermediate}, {args.experts} experts, top-{args.top_k}, "
          f"{args.tokens} tokens, forward+backward{' compiled' if args.compile else ''}, torch {torch.__version__}, "
          f"{where}", flush=True)
    print("| preset | ms / step | vs bf16-mixed | peak GiB | experts' route |\n|---|---:|---:|---:|---|", flush=True)
    base = None
    for preset in args.presets.split(","):
        try:
            r = run(args, preset, args.device)
        except Exception as e:  # noqa: BLE001 - one preset's failure is a row of the table, not the end of it
            print(f"| {preset} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |", flush=True)
            continue
        base = base or (r["ms"] if preset == "bf16-mixed" else None)
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        print(f"| {preset} | {r['ms']:.1f} | {ratio} | {r['peak_gib']:.2f} | {r['route']} |", flush=True)


if __name__ == "__main__":
    main()
