"""A precision plan file: per Linear layer, the compute format `mixprec plan` chose, with
the figures and the reason it chose it. The spec takes it as override rules, one per
layer by its exact name, after the user's own `precision.override` rules (the user's
word wins):

    [plan]
    base = "bf16-mixed"
    objective = "coverage"
    ...
    [layers."layers.0.attention.wq"]
    format = "fp8-rowwise"
    reason = "every GEMM above its floor ..."
    measured."fp8-rowwise" = { forward_db = 29.4, ... }

Only `format` is read back; the rest is for people. A plan naming a module the model
lacks, a format nobody registered, or a file that is not such TOML is bad input: one line.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mixprec.errors import UserError
from mixprec.precision.spec import Override, format_name, parse_format

FORMS = 'a TOML file written by `mixprec plan`: [layers."MODULE"] tables with a format key'


@dataclass(frozen=True)
class PlanFile:
    path: str
    base: str  # the precision preset the plan was measured under
    layers: dict[str, str]  # module FQN -> format name (bfloat16, fp8-rowwise, ...)

    def overrides(self) -> tuple[Override, ...]:
        # exact names: a plan's module names hold no fnmatch wildcards
        return tuple(Override(fqn, parse_format(fmt, f"precision.plan {self.path} layer {fqn!r}"),
                              source=f"precision.plan {self.path}") for fqn, fmt in self.layers.items())


def read_plan(path: str) -> PlanFile:
    where = f"precision.plan {path}"
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; accepted: {FORMS}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, IsADirectoryError) as e:
        raise UserError(f"{where}: not valid TOML ({e}); accepted: {FORMS}") from None
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise UserError(f"{where}: no [layers] tables; accepted: {FORMS}")
    chosen = {}
    for fqn, table in layers.items():
        if not isinstance(table, dict) or not isinstance(table.get("format"), str):
            raise UserError(f"{where}: layer {fqn!r} has no format = \"...\"; accepted: {FORMS}")
        chosen[fqn] = format_name(parse_format(table["format"], f"{where} layer {fqn!r}"))
    base = (data.get("plan") or {}).get("base", "")
    return PlanFile(path, str(base), chosen)


# ---- writing: a small TOML writer for the plan's fixed shape ---------------------------------
def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return '"inf"' if v > 0 else ('"-inf"' if v < 0 else '"nan"')  # TOML has them; readers of JSON not
        return repr(round(v, 4) if isinstance(v, float) else v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _value(k)


def write_plan(path: str | Path, header: dict, layers: dict[str, dict], comment: str = "") -> None:
    """header: the [plan] table; layers: FQN -> {format, reason, ..., measured: {fmt: {...}}}."""
    lines = [f"# {line}" if line else "#" for line in comment.splitlines()]
    lines += ["[plan]"] + [f"{_key(k)} = {_value(v)}" for k, v in header.items()] + [""]
    for fqn, table in layers.items():
        lines.append(f"[layers.{_value(fqn)}]")
        for k, v in table.items():
            if k != "measured":
                lines.append(f"{_key(k)} = {_value(v)}")
        for fmt, figures in table.get("measured", {}).items():
            lines.append(f"measured.{_key(fmt)} = {_value(figures)}")
        lines.append("")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(path)  # never a half-written plan where a good one was
