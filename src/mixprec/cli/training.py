"""`mixprec train`, `audit`, `compare`, `plan`: the commands that take a training config, and what a failed run
says (a rank lost, out of memory with the planner's figures)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mixprec.cli.parser import config_parser
from mixprec.config import load_config
from mixprec.errors import GroupLost, UserError, out_of_memory


def add(sub) -> None:
    """The commands' parsers, each with its handler (`func`)."""
    config_parser(sub, "train", "train a Llama-style model on real text", "Train under a precision policy.")
    config_parser(sub, "audit", "observe the dtypes of one real training step against the policy",
                   "Run one training step (two micro-batches) of the config with hooks and compare the dtype "
                   "observed at each stage with the one the precision policy promises. Exit code 1 when one "
                   "breaks the promise. Works under torchrun.",
                   own=lambda g: g.add_argument("--json", action="store_true", help="print JSON"), own_usage="[--json] ")
    config_parser(sub, "compare", "train several presets side by side and judge them against the first",
                   "Train each preset with the same seed, data, initialisation and steps; write compare.json, "
                   "compare.md, loss_curves.png and speed_memory.png to the run folder. Exit code 1 when a preset "
                   "fails the [compare] thresholds.",
                   own=lambda g: g.add_argument("--presets", default="fp32,bf16-mixed,bf16-true",
                                                help="comma-separated presets; the first is the baseline"),
                   own_usage="[--presets P1,P2,...] ")
    config_parser(sub, "plan", "choose a compute format per Linear layer by measuring each on real training steps",
                   "Run [plan] steps training steps of the config, measure each Linear layer's three GEMMs in each "
                   "candidate format on the real activations and gradients (SQNR against FP32, values flushed or "
                   "saturated, and, for objective speed, GEMM time), choose a format per layer and write the plan "
                   "file (plan.out) that precision.plan takes.")
    for name, func in (("train", cmd_train), ("audit", cmd_audit), ("compare", cmd_compare), ("plan", cmd_plan)):
        sub.choices[name].set_defaults(func=func)


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
    from mixprec.train.policy import build_policy
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
