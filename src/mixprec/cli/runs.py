"""`mixprec export`, `serve-gap`, `generate`: what is done with a run's weights."""

from __future__ import annotations

import argparse
import json

from mixprec.errors import UserError


def add(sub) -> None:
    export = sub.add_parser(
        "export", help="write a run's weights as a Hugging Face folder that transformers loads",
        description="Write the latest checkpoint of a run folder (or a given step-N.pt file or DCP step-N folder, of "
                    "any world size) as a Hugging Face folder: config.json, safetensors (sharded above --max-shard-gb, "
                    "with model.safetensors.index.json) and the run's tokenizer.json. The optimizer state is never "
                    "read. OUT must be new or an empty folder.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder, step-N.pt or a step-N folder")
    export.add_argument("out", metavar="OUT", help="the folder to write (new, or empty)")
    export.add_argument("--dtype", default="bfloat16", help="dtype of the floating-point tensors: bfloat16, "
                        "float32 (exact), float16")
    export.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, GB")
    export.add_argument("--format", default="bf16", help="bf16: every tensor in --dtype; fp8-block: the decoder "
                        "layers' Linears in e4m3 with a float32 scale per 128x128 block (transformers' "
                        "FineGrainedFP8, vLLM); nvfp4, mxfp4: in packed e2m1 (compressed-tensors' pack-quantized "
                        "layouts); the rest in --dtype")
    gap = sub.add_parser(
        "serve-gap", help="what serving a run's model in FP8 or FP4 changes, on its validation data",
        description="Export the run's latest checkpoint in each format, read it back as inference engines "
                    "dequantize it (fp8-block also quantizing each converted Linear's input per token in 1x128 "
                    "groups), and compare its forward with the trained model's on the run's validation batches: "
                    "the absolute gap in each target token's log-probability, KL(trained || served), and the share "
                    "of tokens whose likeliest next token changes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gap.add_argument("run", metavar="RUN", help="a run folder (config.toml and a checkpoint)")
    gap.add_argument("--format", default="fp8-block,nvfp4,mxfp4", help="formats, separated by commas")
    gap.add_argument("--batches", type=int, default=0, help="validation batches (0: the run's eval_batches)")
    gap.add_argument("--json", action="store_true", help="print JSON")
    generate = sub.add_parser(
        "generate", help="print what a model writes after a prompt",
        description="Load a run folder (its latest checkpoint), a checkpoint or a Hugging Face folder and sample a "
                    "continuation of --prompt token by token (FP32).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    generate.add_argument("source", metavar="RUN_OR_FOLDER", help="a run folder, checkpoint or Hugging Face folder")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=100)
    generate.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest token")
    generate.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all")
    generate.add_argument("--seed", type=int, default=0)
    export.set_defaults(func=cmd_export)
    gap.set_defaults(func=cmd_serve_gap)
    generate.set_defaults(func=cmd_generate)


def cmd_export(args: argparse.Namespace) -> int:
    from mixprec.dtypes import parse_dtype
    from mixprec.runs.export import export

    if not args.max_shard_gb > 0:
        raise UserError(f"--max-shard-gb: bad value {args.max_shard_gb}; accepted: a positive number")
    dtype = parse_dtype(args.dtype, "--dtype")
    result = export(args.source, args.out, dtype=dtype, max_shard_bytes=int(args.max_shard_gb * 1e9),
                    fmt=args.format)
    print(f"exported step {result['step']} to {args.out}: {len(result['files'])} safetensors file(s), "
          f"{result['bytes'] / 1e6:.1f} MB in {result['seconds']:.1f} s; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    return 0


def cmd_serve_gap(args: argparse.Namespace) -> int:
    from mixprec.runs.serve_gap import serve_gap

    if args.batches < 0:
        raise UserError(f"--batches: bad value {args.batches}; accepted: 0 (the run's eval_batches) or more")
    result = serve_gap(args.run, [f.strip() for f in args.format.split(",") if f.strip()], args.batches or None)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'format':<10} {'|d log p|':>10} {'KL':>10} {'top-1 changed':>14} {'val loss':>9} {'served':>9}  served as")
    for fmt, r in result.items():
        print(f"{fmt:<10} {r['logprob_gap']:>10.4g} {r['kl']:>10.4g} {100 * r['top1_changed']:>13.2f}% "
              f"{r['val_loss']:>9.4f} {r['served_val_loss']:>9.4f}  {r['served']}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from mixprec.runs.generate import generate, load_model

    for flag, ok, accepted in (("--max-new-tokens", args.max_new_tokens > 0, "a positive integer"),
                               ("--temperature", args.temperature >= 0, "a number >= 0"),
                               ("--top-k", args.top_k >= 0, "an integer >= 0")):
        if not ok:
            raise UserError(f"{flag}: bad value {getattr(args, flag[2:].replace('-', '_'))}; accepted: {accepted}")
    model, tokenizer = load_model(args.source)
    text = generate(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(args.prompt + text)
    return 0
