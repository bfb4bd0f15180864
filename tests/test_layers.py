"""The layers table in docs/architecture.md is the architecture: every import in src/mixprec (those inside
functions included) goes to the importer's own layer or one below it, and no two packages
import each other, however indirectly."""

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "mixprec"


def layers() -> dict[str, int]:
    """{package or top-level module: layer} from docs/architecture.md's table."""
    table = (ROOT / "docs" / "architecture.md").read_text()
    out = {}
    for layer, names in re.findall(r"^\| (\d+) \| ([^|]+) \|", table, flags=re.M):
        for name in re.findall(r"`([\w_]+)`", names):
            out[name] = int(layer)
    return out


def unit(module: str) -> str:
    """mixprec.a.b -> a: the package (or top-level module) a module belongs to."""
    return module.split(".")[1]


def resolve(name: str, src: Path) -> str | None:
    """The longest prefix of `name` that is a module or package of mixprec."""
    parts = name.split(".")
    while len(parts) > 1:
        path = src.parent.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return None


def imports(src: Path = SRC) -> dict[str, set[tuple[str, str]]]:
    """{importing unit: {(imported unit, where)}} across units, every import statement."""
    edges = defaultdict(set)
    for file in src.rglob("*.py"):
        if file == src / "__init__.py":  # the facade: names load lazily from every layer
            continue
        parts = file.relative_to(src.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module.split(".") if parts[-1] == "__init__" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = resolve(name, src) if name.startswith("mixprec.") else None
                if target is not None and unit(target) != unit(module):
                    edges[unit(module)].add((unit(target), f"{file.relative_to(src.parent)}:{node.lineno}"))
    return edges


def test_every_package_is_in_the_table():
    units = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert units == set(layers()), f"in the tree, not the table: {units - set(layers())}; " \
                                   f"in the table, not the tree: {set(layers()) - units}"


def test_no_import_points_up():
    layer = layers()
    up = sorted(f"{where}: {src} (layer {layer[src]}) imports {dst} (layer {layer[dst]})"
                for src, targets in imports().items() for dst, where in targets if layer[dst] > layer[src])
    assert not up, "\n".join(up)


def test_no_import_cycle_between_packages():
    graph = {src: {dst for dst, _ in targets} for src, targets in imports().items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo += graph.get(node, ())
        return False

    cycles = sorted({" <-> ".join(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert not cycles, cycles


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """A function-level import is an import, and so is a relative one."""
    for path, text in {"mixprec/a/__init__.py": "", "mixprec/a/x.py": "def f():\n    from mixprec.b.y import g\n",
                       "mixprec/b/__init__.py": "", "mixprec/b/y.py": "from ..c import h\n",
                       "mixprec/c.py": "import mixprec.a.x\n"}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    found = {src: {dst for dst, _ in targets} for src, targets in imports(tmp_path / "mixprec").items()}
    assert found == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
