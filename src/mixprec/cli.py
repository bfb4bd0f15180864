"""`mixprec` command line: `mixprec train [--config FILE.toml] [--section.key value ...]`,
and the audit, plan, formats, memory, analyze, compare and demo commands."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from mixprec.config import TABLES, field_docs, field_types, load_config
from mixprec.errors import GroupLost, TrainingUnstable, UserError, out_of_memory


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit code 2."""

    def error(self, message: str):
        if "unrecognized arguments" in message:
            unknown = message.split(":", 1)[1].split()
            flag = next((a for a in unknown if a.startswith("--")), unknown[0])
            parsers = [self] + [sub for a in self._actions if isinstance(a, argparse._SubParsersAction)
                                for sub in a.choices.values()]
            known = [o for p in parsers for a in p._actions for o in a.option_strings]
            close = difflib.get_close_matches(flag.split("=")[0], known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            message = f"unknown option {flag}; {hint}accepted: --config and --section.key (see {self.prog} --help)"
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _config_parser(sub, name: str, help: str, description: str, own=None,
                   own_usage: str = "") -> argparse.ArgumentParser:
    """A subcommand that takes a training config: its own options (`own(parser)`) first,
    then --config FILE, then every --section.key grouped by table."""
    usage = f"mixprec {name} [-h] {own_usage}[--config FILE.toml] [--section.key VALUE ...]"
    p = sub.add_parser(name, help=help, description=description + " Precedence: --section.key > --config file > "
                       "defaults.", usage=usage, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if own is not None:
        own(p)
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with [job], [model], ... tables")
    for table, cls in TABLES.items():
        group = p.add_argument_group(f"[{table}]")
        docs, types = field_docs(cls), field_types(cls)
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            # Values stay strings here; load_config converts and checks them by the field's type.
            kind = types[f.name]
            group.add_argument(f"--{table}.{f.name}", dest=f"{table}.{f.name}",
                               metavar="LIST" if kind == tuple[str, ...] else kind.__name__.upper(),
                               default=argparse.SUPPRESS, nargs="?" if types[f.name] is bool else None,
                               const="true" if types[f.name] is bool else None,
                               help=f"{docs.get(f.name, '')} (default: {default!r})".replace("%", "%%"))
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixprec", description="Mixed-precision training on PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _config_parser(sub, "train", "train a Llama-style model on real text", "Train under a precision policy.")
    _config_parser(sub, "audit", "observe the dtypes of one real training step against the policy",
                   "Run one training step (two micro-batches) of the config with hooks and compare the dtype "
                   "observed at each stage with the one the precision policy promises. Exit code 1 when one "
                   "breaks the promise. Works under torchrun.",
                   own=lambda g: g.add_argument("--json", action="store_true", help="print JSON"), own_usage="[--json] ")
    _config_parser(sub, "compare", "train several presets side by side and judge them against the first",
                   "Train each preset with the same seed, data, initialisation and steps; write compare.json, "
                   "compare.md, loss_curves.png and speed_memory.png to the run folder. Exit code 1 when a preset "
                   "fails the [compare] thresholds.",
                   own=lambda g: g.add_argument("--presets", default="fp32,bf16-mixed,bf16-true",
                                                help="comma-separated presets; the first is the baseline"),
                   own_usage="[--presets P1,P2,...] ")
    _config_parser(sub, "plan", "choose a compute format per Linear layer by measuring each on real training steps",
                   "Run [plan] steps training steps of the config, measure each Linear layer's three GEMMs in each "
                   "candidate format on the real activations and gradients (SQNR against FP32, values flushed or "
                   "saturated, and, for objective speed, GEMM time), choose a format per layer and write the plan "
                   "file (plan.out) that precision.plan takes.")
    prepare = sub.add_parser(
        "prepare", help="tokenize text once into token shards that train reads a window at a time (data.source DIR)",
        description="Tokenize SOURCE (stdlib, a text, .jsonl or .gz file, or a folder of them) into token shards "
                    "in DIR: streaming, on every core, resumable (a re-run keeps finished shards). Train on them "
                    "with --data.source DIR.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    prepare.add_argument("source", help="stdlib, a text/.jsonl/.gz file, or a folder")
    prepare.add_argument("--out", required=True, metavar="DIR", help="folder for the shards and index.json")
    prepare.add_argument("--tokenizer", default="byte", metavar="byte|bpe|PATH",
                         help="byte (UTF-8 bytes), bpe (a byte-level BPE trained on a sample of the training text), "
                              "or a Hugging Face tokenizer.json (nothing downloaded)")
    prepare.add_argument("--bpe-vocab-size", type=int, default=4096, help="vocabulary of the trained BPE")
    prepare.add_argument("--bpe-sample-mb", type=float, default=64.0, help="MB of training text the BPE learns from")
    prepare.add_argument("--val-fraction", type=float, default=0.05, help="share held out for validation")
    prepare.add_argument("--text-field", default="text", help="the text's field in .jsonl records")
    prepare.add_argument("--shard-mb", type=float, default=128.0, help="MB of text a shard (and a worker's unit)")
    prepare.add_argument("--workers", type=int, default=0, help="worker processes (0: one a core)")
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
    return parser


def _setup_logging(stream_name: str) -> None:
    class TqdmHandler(logging.Handler):
        def emit(self, record):
            stream = getattr(sys, stream_name)  # looked up each time: tests and tqdm swap it
            try:
                from tqdm.auto import tqdm

                tqdm.write(self.format(record), file=stream)
            except ImportError:
                print(self.format(record), file=stream)
            stream.flush()  # log lines arrive as they happen when the stream is a file

    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("[mixprec] %(levelname)s %(message)s"))
    root = logging.getLogger("mixprec")
    root.handlers[:] = [handler]
    # Under torchrun only rank 0 speaks, unless something is wrong.
    root.setLevel(logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING)
    root.propagate = False


def cmd_train(args: argparse.Namespace) -> int:
    from mixprec.train.trainer import Trainer

    overrides = {k: v for k, v in vars(args).items() if "." in k}
    config = load_config(args.config, overrides)
    try:
        summary = Trainer(config).train()
    except (MemoryError, RuntimeError) as e:
        if _lost_rank(e):
            from mixprec.distributed.elastic import first_line

            raise GroupLost(f"a rank was lost or a wait passed parallelism.timeout_s {config.parallelism.timeout_s:g} "
                            f"s ({type(e).__name__}: {first_line(e)})") from None
        if not out_of_memory(e):
            raise
        raise UserError(_memory_advice(config, e)) from None
    if int(os.environ.get("RANK", "0")) > 0:
        return 0
    print(f"run folder: {config.job.dump_folder}")
    def num(key: str, spec: str) -> str:
        return "n/a" if summary.get(key) is None else format(summary[key], spec)

    print(f"final validation loss {num('final_val_loss', '.4f')}, perplexity {num('val_perplexity', '.2f')} "
          f"({summary['precision']}, {summary['steps']} steps, {num('tokens_per_sec', '.0f')} tokens/s)")
    return 0


def _lost_rank(e: BaseException) -> bool:
    """Under torchrun: torch.distributed's errors of a wait timed out, or gloo's of a peer gone."""
    import torch.distributed as dist

    gone = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and (
        isinstance(e, dist.DistError) or any(g in str(e) for g in gone))


def _memory_advice(config, error: BaseException) -> str:
    """One line: what the planner says this run needs per device, and what to change."""
    import torch

    from mixprec.analysis.memory import Setup, plan
    from mixprec.config import build_policy
    from mixprec.train.build import model_shape

    name = type(error).__name__
    try:
        policy = build_policy(config.precision, config.training, config.loss_scale, config.fp8)
        policy_name = policy.name
        t = config.training
        device_type = "cuda" if t.device.startswith("cuda") or (t.device == "auto" and torch.cuda.is_available()) \
            else "cpu"
        vocab = 256 if config.data.tokenizer == "byte" else config.data.bpe_vocab_size
        args = model_shape(config, vocab, device_type)  # the trainer's own choices of attention and loss
        setup = Setup(args, policy.spec, t.local_batch_size, t.seq_len, checkpointing=config.activation_checkpoint.mode,
                      dp_shard=max(1, config.parallelism.data_parallel_shard_degree), attention=args.attention,
                      loss="chunked" if args.loss_chunk else "full",
                      lowp_all_gather=config.parallelism.lowp_all_gather)
        b = plan(setup)["bytes"]
        need = (f"the plan for {config.model.flavor} in {policy_name} is {b['peak'] / 2**30:.1f} GiB per device "
                f"(parameters {b['parameters'] / 2**30:.1f}, optimizer states {b['optimizer_states'] / 2**30:.1f}, "
                f"activations {b['activations'] / 2**30:.1f}; mixprec memory shows it all)")
    except Exception:  # a custom policy the planner does not model: the advice without figures
        need = "mixprec memory estimates what a setup needs"
    return (f"out of memory ({name}): {need}; accepted: a smaller model.flavor or training.local_batch_size, "
            "activation_checkpoint.mode full, or more ranks (FSDP2 shards the model state)")


def cmd_audit(args: argparse.Namespace) -> int:
    from mixprec.analysis.audit import format_audit, run_audit

    config = load_config(args.config, {k: v for k, v in vars(args).items() if "." in k})
    report = run_audit(config)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(report, indent=2) if args.json else format_audit(report))
    return 0 if report["ok"] else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from mixprec.train.compare import run_compare

    config = load_config(args.config, {k: v for k, v in vars(args).items() if "." in k})
    report = run_compare(config, [p.strip() for p in args.presets.split(",") if p.strip()])
    if int(os.environ.get("RANK", "0")) == 0:
        print((Path(config.job.dump_folder) / "compare.md").read_text())
    return 0 if report["passed"] else 1


def cmd_plan(args: argparse.Namespace) -> int:
    import time

    from mixprec.plan.planner import for_planning, format_plan, plan_layers, save
    from mixprec.train.trainer import Trainer

    config = for_planning(load_config(args.config, {k: v for k, v in vars(args).items() if "." in k}))
    t0 = time.perf_counter()
    trainer = Trainer(config)  # the config's model, data and base mode; its step is what the planner runs
    if trainer.dims.world_size > 1:
        raise UserError("mixprec plan runs in one process; accepted: python -m mixprec plan (not under torchrun)")
    report = plan_layers(trainer.raw_model, trainer.policy, trainer.train_step, config.plan, trainer.device,
                         config.model.hf_config or f"{config.model.flavor} flavor", exclude=config.fp8.filter_fqns,
                         started=t0, progress=config.metrics.progress_bar)
    save(report, config.plan.out, plot=config.metrics.plot)
    print(format_plan(report))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from mixprec.data.prepare import run_prepare

    try:
        index = run_prepare(args.source, args.out, args.tokenizer, args.bpe_vocab_size, args.val_fraction,
                            args.text_field, args.shard_mb, args.bpe_sample_mb, args.workers)
    except KeyboardInterrupt:
        sys.stderr.write(f"mixprec prepare: interrupted; the shards finished so far are kept: run the same command "
                         f"to finish {args.out}\n")
        return 130
    print(f"prepared {args.out}: {index['tokens']['train']} training and {index['tokens']['val']} validation tokens "
          f"({index['tokenizer']['kind']} tokenizer, {index['dtype']}); train with --data.source {args.out}")
    return 0


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
        from mixprec.narrow.accumulation import run as run_accumulation

        return run_accumulation(args.json, args.plot)
    from mixprec.demo import run

    return run(args.json)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _setup_logging("stderr" if getattr(args, "json", False) else "stdout")  # --json: stdout is the JSON
    commands = {"train": cmd_train, "compare": cmd_compare, "audit": cmd_audit, "plan": cmd_plan, "formats": cmd_formats, "memory": cmd_memory,
                "prepare": cmd_prepare, "export": cmd_export, "generate": cmd_generate, "serve-gap": cmd_serve_gap,
                "analyze": cmd_analyze, "demo": cmd_demo}
    try:
        code = commands[args.command](args)
    except UserError as e:
        sys.stderr.write(f"mixprec {args.command}: error: {e}\n")
        code = 2
    except TrainingUnstable as e:
        sys.stderr.write(f"mixprec {args.command}: unstable: {e}\n")
        code = 3
    except GroupLost as e:
        sys.stderr.write(f"mixprec {args.command}: process group: {e}\n")
        code = 1
    except BaseException:
        _leave_process_group()
        raise
    if _in_process_group():  # under torchrun
        from mixprec.distributed.parallel import exit_process_group

        exit_process_group(code)
    return code


def _in_process_group() -> bool:
    if "torch.distributed" not in sys.modules:  # commands that never load torch stay fast
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _leave_process_group() -> None:
    """On an unexpected error under torchrun, leave the process group before the traceback."""
    if _in_process_group():
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
