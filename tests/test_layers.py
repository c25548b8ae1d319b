"""The package layering holds: imports name the defining module, `store` is bytes only, no cycles.

Read from the source with ``ast`` (nothing is imported), so the check is the
same on every machine: every ``from hybridkv.X import name`` must name a module
that defines ``name`` (no re-export shims), ``hybridkv.store`` imports nothing
from the layers above it, and the module-level import graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOTS = [SRC, SRC.parent / "tests", SRC.parent / "benchmarks"]

#: Packages, lowest first; a package may import only from packages listed before it.
LAYERS = ["hybridkv.model", "hybridkv.store", "hybridkv.cache", "hybridkv.tiers", "hybridkv.engine",
          "hybridkv.api", "hybridkv.fleet", "hybridkv.replay", "hybridkv.serve", "hybridkv.cli"]


#: The one module allowed to re-export: the package's documented public API (README).
PUBLIC_API = "hybridkv"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in SRC.rglob("*.py")}


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines at top level (functions, classes, assignments), not ones it imports."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def _imports(tree: ast.Module, top_level_only: bool):
    """``(module, name or None, line)`` for every ``hybridkv`` import (module level only, or all)."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridkv"):
            for alias in node.names:
                yield node.module, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hybridkv"):
                    yield alias.name, None, node.lineno


def _layer(module: str) -> int | None:
    for i, pkg in enumerate(LAYERS):
        if module == pkg or module.startswith(pkg + "."):
            return i
    return None


def test_every_import_names_the_defining_module():
    mods = _modules()
    bad = []
    files = [p for root in ROOTS for p in root.rglob("*.py")]
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for module, name, line in _imports(tree, top_level_only=False):
            if name is None or module not in mods or module == PUBLIC_API:   # the documented public API
                continue
            if f"{module}.{name}" in mods:          # a submodule: from hybridkv.store import disk
                continue
            if name not in _defined(mods[module]):
                bad.append(f"{path.relative_to(SRC.parent)}:{line}: {name} is not defined in {module}")
    assert not bad, "\n".join(bad)


def test_no_module_reexports_names_it_does_not_define():
    bad = []
    for module, tree in _modules().items():
        if module == PUBLIC_API:
            continue
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    name = alias.asname or alias.name.split(".")[0]
                    if name not in used and name != "annotations":
                        bad.append(f"{module}:{node.lineno} imports {name} without using it (a re-export)")
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                       for t in node.targets):
                bad.append(f"{module}:{node.lineno} has __all__")
    assert not bad, "\n".join(bad)


def test_packages_import_only_downward():
    bad = []
    for module, tree in _modules().items():
        mine = _layer(module)
        if mine is None:
            continue
        for target, _, line in _imports(tree, top_level_only=False):
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{module}:{line} imports {target} (a higher layer)")
    assert not bad, "\n".join(bad)


def test_store_is_bytes_only():
    above = ("hybridkv.cache", "hybridkv.tiers", "hybridkv.engine", "hybridkv.model", "hybridkv.replay")
    for module, tree in _modules().items():
        if module.startswith("hybridkv.store"):
            for target, _, line in _imports(tree, top_level_only=False):
                assert not target.startswith(above), f"{module}:{line} imports {target}"


def test_no_import_cycle():
    mods = _modules()
    graph = {m: {t for t, _, _ in _imports(tree, top_level_only=True) if t in mods and t != m}
             for m, tree in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [m, t]) if t in stack
                            else f"import cycle through {m} -> {t}")
            if t not in state:
                visit(t, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
