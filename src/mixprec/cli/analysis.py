"""`mixprec formats`, `memory`, `analyze`, `demo`: numbers about formats, a setup's memory, a step's gradients,
and the numerics demonstrations."""

from __future__ import annotations

import argparse
import json

from mixprec.errors import UserError


def add(sub) -> None:
    formats = sub.add_parser("formats", help="limits of FP32, TF32, FP16, BF16, FP8 E4M3 and E5M2")
    formats.add_argument("--json", action="store_true", help="print JSON")
    memory = sub.add_parser("memory", help="plan per-device memory and per-step communication",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    memory.add_argument("--flavor", default="small", help="debug, small, 1B, 8B, 70B (Llama 3 shapes); moe-debug, "
                        "moe-small, moe-16B (mixtures of experts: planned by running their step on fake tensors)")
    memory.add_argument("--hf-config", default="", metavar="PATH",
                        help="a Hugging Face causal LM's config.json (or folder) instead of a flavor: planned by "
                             "running one step on fake tensors (--preset, --batch, --seq-len, --dp-shard apply)")
    memory.add_argument("--vocab-size", type=int, default=256, help="for flavors without their own vocabulary")
    memory.add_argument("--preset", default="bf16-mixed", help="precision mode")
    memory.add_argument("--override", default="", metavar="RULES",
                        help="per-module compute, PATTERN=FORMAT rules separated by commas (as precision.override)")
    memory.add_argument("--optimizer", default="adamw", help="adamw, sgd (momentum), none")
    memory.add_argument("--batch", type=int, default=4, help="sequences per device and micro-batch")
    memory.add_argument("--seq-len", type=int, default=256)
    memory.add_argument("--checkpointing", default="none", help="activation checkpointing: none, selective "
                        "(every other block), full")
    memory.add_argument("--dp-shard", type=int, default=1, help="FSDP2 degree")
    memory.add_argument("--dp-replicate", type=int, default=1, help="DDP / HSDP replicas")
    memory.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    memory.add_argument("--ep", type=int, default=1, help="expert-parallel degree (an MoE flavor; divides --dp-shard): "
                        "planned at the worst load, every rank's routed rows dispatched to one rank")
    memory.add_argument("--expert-dispatch", default="base", help="base or fp8 (parallelism.expert_dispatch)")
    memory.add_argument("--attention", default="eager", help="eager or sdpa (model.attention)")
    memory.add_argument("--loss", default="full", help="full or chunked (model.loss)")
    memory.add_argument("--no-reshard", action="store_true", help="keep all-gathered parameters after forward")
    memory.add_argument("--no-lowp-all-gather", action="store_true",
                        help="FP8/microscaled weights all-gathered in bfloat16 (parallelism.lowp_all_gather = false)")
    memory.add_argument("--bandwidth-gbps", type=float, default=100.0, help="per-device link, GB/s")
    memory.add_argument("--json", action="store_true", help="print JSON")
    analyze = sub.add_parser("analyze", help="numerics experiments and a gradient census of a real step",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    analyze.add_argument("--flavor", default="small", help="model for the gradient census")
    analyze.add_argument("--text", help="UTF-8 text file for the census batch (default: Python's argparse source)")
    analyze.add_argument("--batch", type=int, default=4)
    analyze.add_argument("--seq-len", type=int, default=256)
    analyze.add_argument("--loss-scale", type=float, default=1.0, help="gradients are multiplied by this")
    analyze.add_argument("--init-std", type=float, default=0.02, help="weight scale for the quantisation experiment")
    analyze.add_argument("--out", default="outputs/analyze", help="folder for gradient_census.png")
    analyze.add_argument("--json", action="store_true", help="print JSON")
    demo = sub.add_parser("demo", help="numerics demonstrations")
    demo.add_argument("topic", choices=["reduction", "fp8-accumulation"],
                      help="reduction: why gradients are reduced in float32; fp8-accumulation: a 14-bit FP8 GEMM "
                           "accumulator against DeepSeek-V3's promotion to FP32 every 128 products")
    demo.add_argument("--json", action="store_true", help="print JSON")
    demo.add_argument("--plot", default="fp8_accumulation.png", help="fp8-accumulation: where to write the plot")
    for name, func in (("formats", cmd_formats), ("memory", cmd_memory), ("analyze", cmd_analyze),
                       ("demo", cmd_demo)):
        sub.choices[name].set_defaults(func=func)


def cmd_formats(args: argparse.Namespace) -> int:
    from mixprec.analysis.formats import FORMATS, format_table

    print(json.dumps([f.to_dict() for f in FORMATS.values()], indent=2) if args.json else format_table())
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from mixprec.analysis.memory import Setup, plan
    from mixprec.models.llama import model_args
    from mixprec.precision.presets import resolve_preset_name

    for flag, value in (("--batch", args.batch), ("--seq-len", args.seq_len), ("--dp-shard", args.dp_shard),
                        ("--dp-replicate", args.dp_replicate), ("--tp", args.tp), ("--ep", args.ep)):
        if value < 1:  # every route (the formula, the fake step of an MoE flavor or a transformers model)
            raise UserError(f"{flag} {value}: accepted: a positive integer")
    if args.hf_config:
        return _memory_hf(args)
    shape = model_args(args.flavor, args.vocab_size)
    if args.ep != 1:
        from mixprec.distributed.expert_parallel import check
        from mixprec.distributed.parallel import ParallelDims

        if args.expert_dispatch not in ("base", "fp8"):
            raise UserError(f"--expert-dispatch {args.expert_dispatch!r}; accepted: base, fp8")
        check(shape.n_experts, ParallelDims.resolve(args.dp_replicate, args.dp_shard, args.tp, args.dp_replicate *
                                                    args.dp_shard * args.tp, args.ep), f"{args.flavor} flavor")
    if shape.n_experts:
        from mixprec.models.llama import construct
        from mixprec.precision import Policy

        storage = Policy.from_preset(resolve_preset_name(args.preset, "--preset")).storage_dtype
        return _memory_fake(args, lambda: construct(shape, storage), f"{args.flavor} (a mixture of experts, its step "
                            "run on fake tensors)", f"--flavor {args.flavor}")

    setup = Setup(shape, resolve_preset_name(args.preset, "--preset"),
                  overrides=tuple(r for r in args.override.split(",") if r.strip()), batch=args.batch, seq_len=args.seq_len, optimizer=args.optimizer, checkpointing=args.checkpointing,
                  dp_shard=args.dp_shard, dp_replicate=args.dp_replicate, tp=args.tp,
                  reshard_after_forward=not args.no_reshard, lowp_all_gather=not args.no_lowp_all_gather,
                  attention=args.attention, loss=args.loss,
                  bandwidth_gbps=args.bandwidth_gbps)
    result = plan(setup)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.flavor} ({result['parameters'] / 1e6:.1f}M parameters), {setup.preset}, {args.optimizer}, batch "
          f"{args.batch} x {args.seq_len}, checkpointing {args.checkpointing}, dp_shard {args.dp_shard} x "
          f"dp_replicate {args.dp_replicate} x tp {args.tp}; per device:")
    for name, value in result["bytes"].items():
        print(f"  {name.replace('_', ' '):<24} {value / 2**30:10.3f} GiB")
    print(f"  model state per parameter {result['model_state_bytes_per_parameter']:.1f} bytes (optimizer states "
          f"{result['optimizer_state_bytes_per_parameter']:.2f})")
    comm = result["communication_bytes"]
    print("communication per step: " + ", ".join(f"{k.replace('_', '-')} {v / 2**30:.3f} GiB" for k, v in comm.items())
          + f"; {result['communication_seconds'] * 1e3:.1f} ms at {args.bandwidth_gbps:g} GB/s")
    return 0


def _memory_hf(args: argparse.Namespace) -> int:
    """mixprec memory --hf-config: the model's step run on fake tensors (mixprec.plan_memory)."""
    from mixprec.models.hf import HFCausalLM, load_hf_config

    if args.ep != 1:
        raise UserError(f"mixprec memory --hf-config with --ep {args.ep}: expert parallelism runs mixprec's own MoE "
                        "flavors; accepted: leave --ep out")
    config = load_hf_config(args.hf_config)
    title = f"{type(config).__name__.removesuffix('Config')} from {args.hf_config}"
    return _memory_fake(args, lambda: HFCausalLM(config), title, "--hf-config")


def _memory_fake(args: argparse.Namespace, build, title: str, flag: str) -> int:
    """The step of the model `build()` makes, run on fake tensors (mixprec.plan_memory): transformers
    models and mixprec's mixtures of experts, whose routed activations the formula does not model."""
    import torch

    from mixprec.analysis.plan_model import plan_memory
    from mixprec.precision.presets import resolve_preset_name

    for option, value, default in (("--dp-replicate", args.dp_replicate, 1),
                                   ("--tp", args.tp, 1), ("--checkpointing", args.checkpointing, "none"),
                                   ("--override", args.override, ""), ("--optimizer", args.optimizer, "adamw")):
        if value != default:
            raise UserError(f"mixprec memory {flag} with {option} {value}: not planned yet (FSDP2 by --dp-shard, "
                            f"AdamW, no checkpointing); accepted: leave {option} out")
    preset = resolve_preset_name(args.preset, "--preset")
    tokens = torch.zeros(args.batch, args.seq_len, dtype=torch.long)
    result = plan_memory(build, preset, (tokens, tokens), dp_shard=args.dp_shard, ep=args.ep,
                         expert_dispatch=args.expert_dispatch)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    ep = f" x ep {args.ep} (the worst load: every rank's routed rows on this rank)" if args.ep > 1 else ""
    print(f"{title} ({result['parameters'] / 1e6:.1f}M parameters), {preset}, batch {args.batch} x {args.seq_len}, "
          f"dp_shard {args.dp_shard}{ep}; per device, peak {result['peak_bytes'] / 2**30:.3f} GiB:")
    for kind, value in result["by_kind"].items():
        print(f"  {kind:<10} {value / 2**30:10.3f} GiB")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mixprec.analysis.run import analyze, format_analysis

    report = analyze(args.flavor, args.text, args.batch, args.seq_len, args.loss_scale, args.init_std, Path(args.out))
    print(json.dumps(report, indent=2) if args.json else format_analysis(report))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.topic == "fp8-accumulation":
        from mixprec.narrow.gemm.accumulation import run as run_accumulation

        return run_accumulation(args.json, args.plot)
    from mixprec.demo import run

    return run(args.json)
