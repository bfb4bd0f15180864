"""`mixprec` command line: `mixprec train [--config FILE.toml] [--section.key value ...]`, and the audit, plan,
prepare, export, serve-gap, generate, formats, memory, analyze, compare and demo commands: one module a family of
commands, each command's options beside its handler (training, data, runs, analysis); the parser and what every
command shares here."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from mixprec.cli import analysis, data, runs, training
from mixprec.cli.parser import Parser
from mixprec.errors import GroupLost, TrainingUnstable, UserError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mixprec", description="Mixed-precision training on PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for family in (training, data, runs, analysis):  # the order `mixprec --help` lists them in
        family.add(sub)
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _setup_logging("stderr" if getattr(args, "json", False) else "stdout")  # --json: stdout is the JSON
    try:
        code = args.func(args)
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
