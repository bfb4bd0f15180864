"""`mixprec` command line: `mixprec train [--config FILE.toml] [--section.key value ...]`."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from dataclasses import MISSING, fields

from mixprec.config import TABLES, field_docs, field_types, load_config
from mixprec.errors import UserError


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


def _train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a Llama-style model on real text", description=(
        "Train under a precision policy. Precedence: --section.key > --config file > defaults."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with [job], [model], ... tables")
    for table, cls in TABLES.items():
        group = p.add_argument_group(f"[{table}]")
        docs, types = field_docs(cls), field_types(cls)
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            # Values stay strings here; load_config converts and checks them by the field's type.
            group.add_argument(f"--{table}.{f.name}", dest=f"{table}.{f.name}", metavar=types[f.name].__name__.upper(),
                               default=argparse.SUPPRESS, nargs="?" if types[f.name] is bool else None,
                               const="true" if types[f.name] is bool else None,
                               help=f"{docs.get(f.name, '')} (default: {default!r})".replace("%", "%%"))
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixprec", description="Mixed-precision training on PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _train_parser(sub)
    demo = sub.add_parser("demo", help="numerics demonstrations")
    demo.add_argument("topic", choices=["reduction"], help="reduction: why gradients are reduced in float32")
    demo.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _setup_logging() -> None:
    class TqdmHandler(logging.Handler):
        def emit(self, record):
            try:
                from tqdm.auto import tqdm

                tqdm.write(self.format(record), file=sys.stdout)
            except ImportError:
                print(self.format(record))
            sys.stdout.flush()  # log lines arrive as they happen when stdout is a file

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
    summary = Trainer(config).train()
    if int(os.environ.get("RANK", "0")) > 0:
        return 0
    print(f"run folder: {config.job.dump_folder}")
    print(f"final validation loss {summary['final_val_loss']:.4f}, perplexity {summary['val_perplexity']:.2f} "
          f"({summary['precision']}, {summary['steps']} steps, {summary['tokens_per_sec'] or 0:.0f} tokens/s)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mixprec.demo import run

    return run(args.json)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _setup_logging()
    try:
        return {"train": cmd_train, "demo": cmd_demo}[args.command](args)
    except UserError as e:
        sys.stderr.write(f"mixprec {args.command}: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
