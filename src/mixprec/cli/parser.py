"""The command line's parser: one-line errors with exit code 2, and the options of the commands that take a
training config (--config FILE, then every --section.key grouped by table)."""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import MISSING, fields

from mixprec.config import TABLES, field_docs, field_types


class Parser(argparse.ArgumentParser):
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


def config_parser(sub, name: str, help: str, description: str, own=None,
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
