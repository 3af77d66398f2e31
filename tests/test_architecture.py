"""The package's shape: no import cycles among its modules (function-level imports included), and
every subpackage imports only the layers below it, as its ``__init__`` docstring says."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "deepcabac_py"

# What each part of the package may import besides itself (the subpackages' docstrings say the same).
ALLOWED = {
    "errors": set(),
    "_jit": {"errors"},
    "io": {"errors", "_jit"},
    "entropy": {"errors", "_jit"},
    "quant": {"errors", "_jit", "io", "entropy"},
    "model": {"errors", "_jit", "io", "entropy", "quant"},
    "tuning": {"errors", "io", "model", "quant"},
    "updates": {"errors", "_jit", "io", "entropy", "quant", "model"},
    "matrix": {"errors", "_jit", "io", "quant", "model"},
    "series": {"errors", "_jit", "io", "quant", "model"},
    "integrations": {"errors", "io", "entropy", "quant", "model", "tuning", "updates", "matrix", "series"},
    "cli": {"errors", "io", "entropy", "quant", "model", "tuning", "updates", "matrix", "series"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, wherever the import statement stands."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - (node.level - 1)] if node.level else []
            head = ".".join(base + ([node.module] if node.module else []))
            targets = [head] + [f"{head}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            # the module itself, or the package it names
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_walk_sees_every_kind_of_import():
    graph = _graph()
    assert "deepcabac_py.model.container" in graph["deepcabac_py.model.decoder"]  # from .container import
    assert "deepcabac_py.entropy.levelcoder" in graph["deepcabac_py.quant.quantizers"]  # from ..entropy import
    assert "deepcabac_py.io.checkpoint" in graph["deepcabac_py.model.report"]  # inside a function
    assert "deepcabac_py.model.decoder" in graph["deepcabac_py.cli.main"]  # absolute, inside a command


def test_no_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(part):
    wrong = []
    for module, targets in _graph().items():
        if _part(module) != part:
            continue
        for target in targets:
            other = _part(target)
            if other is not None and other != part and other not in ALLOWED[part]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_every_subpackage_says_what_it_owns_and_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "May import" in doc, f"{init.parent.name}/__init__.py: a docstring with 'May import: ...'"
