"""mixprec.narrow's packages by concept, in floors (docs/architecture.md): each imports only its own floor and
those below (function-level imports included), and no module of narrow imports itself back through others."""

import ast
from collections import defaultdict
from pathlib import Path

NARROW = Path(__file__).resolve().parents[2] / "src" / "mixprec" / "narrow"
FLOORS = {"kernels": 0, "formats": 1, "gemm": 2, "linear": 3, "experts": 4, "fsdp": 5, "convert": 6, "__init__": 7}


def _module(file: Path) -> str:
    parts = file.relative_to(NARROW).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def _imports() -> dict[str, set[str]]:
    """{narrow module: {narrow modules it imports}} (a package's import counts as its __init__)."""
    modules = {_module(f): f for f in NARROW.rglob("*.py")}
    edges = defaultdict(set)
    for name, file in modules.items():
        for node in ast.walk(ast.parse(file.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mixprec.narrow"):
                base = node.module.removeprefix("mixprec.narrow").lstrip(".")
                targets = [f"{base}.{a.name}".strip(".") for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name.removeprefix("mixprec.narrow").lstrip(".") for a in node.names
                           if a.name.startswith("mixprec.narrow.")]
            for t in targets:
                if t in modules and t != name:
                    edges[name].add(t)
    return edges


def _floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def test_every_package_of_narrow_has_a_floor():
    assert {_module(f).split(".")[0] for f in NARROW.rglob("*.py")} == set(FLOORS)


def test_no_import_in_narrow_runs_up_a_floor():
    up = sorted(f"{a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})"
                for a, targets in _imports().items() for b in targets
                if a != "__init__" and b != "__init__" and _floor(b) > _floor(a))
    assert not up, "\n".join(up)


def test_no_import_circle_between_narrows_modules():
    graph = _imports()
    graph.pop("__init__", None)  # the face imports the layers; none of them imports it
    seen, on_path, circles = set(), [], []

    def visit(node):
        if node in on_path:
            circles.append(on_path[on_path.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt != "__init__":
                visit(nxt)
        on_path.pop()

    for node in sorted(graph):
        visit(node)
    assert not circles, circles


def test_the_face_keeps_its_public_names():
    """What the docs import from mixprec.narrow, whichever package now holds it."""
    import mixprec.narrow as face

    assert {"convert_to_fp8", "register_recipe", "FP8Recipe", "MXRecipe", "FP8Linear", "MXLinear", "RECIPES",
            "quantize", "scaled_mm", "Quantized"} <= set(face.__all__)
    missing = [name for name in face.__all__ if not hasattr(face, name)]
    assert not missing, missing
    assert face.register_recipe.__module__ == "mixprec.narrow.formats.recipe"
