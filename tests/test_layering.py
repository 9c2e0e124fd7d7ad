"""Imports go downward only, and no module imports itself back through others.

An AST scan of every module under ``cp_passes/``: module-level and function-local imports (lazy imports count),
relative and absolute, ``TYPE_CHECKING`` blocks included. The layers, top to bottom, are those of
``cp_passes/CONTRIBUTING.md``; a module may import its own layer and the layers below it.
"""

from __future__ import annotations

import ast
import collections
import pathlib


ROOT = pathlib.Path(__file__).resolve().parent.parent / "cp_passes"

LAYERS = [
    ("top", ["cp_passes", "cp_passes.__main__"]),
    ("tools", ["cp_passes.tools"]),
    ("compiler", ["cp_passes.compiler"]),
    ("report", ["cp_passes.report"]),
    ("rules", ["cp_passes.rules"]),
    ("match", ["cp_passes.match"]),
    ("transports", ["cp_passes.transports", "cp_passes.helpers"]),
    ("foundation", ["cp_passes.graph", "cp_passes.data", "cp_passes.layout", "cp_passes.key_plan", "cp_passes.spec",
                    "cp_passes.errors", "cp_passes.group", "cp_passes.kernels", "cp_passes.lifted",
                    "cp_passes.selective_scan", "cp_passes.functions", "cp_passes.eager_modules", "cp_passes.experts",
                    "cp_passes.data_parallel"]),
]
"""Top to bottom. ``helpers`` (gather_halo and friends, for code outside the compiled module) calls the
transports' ops, so it sits with them."""


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package (a package by its ``__init__``)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module ``name`` names, or the innermost package of cp_passes that holds it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import of a cp_passes module in ``module``'s file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                     for alias in node.names]
        else:
            continue
        for name in names:
            if name == "cp_passes" or name.startswith("cp_passes."):
                target = _resolve(name)
                if target is not None and target != module:
                    found.append((target, node.lineno))
    return list(dict.fromkeys(found))


EDGES = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> int | None:
    """The index of ``module``'s layer in :data:`LAYERS` (0 is the top), by its longest listed prefix."""
    best, at = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, at = len(prefix), index
    return at


def _where(module: str, imported: str, line: int) -> str:
    return f"{module} -> {imported} (line {line})"


def test_every_module_has_a_layer():
    unplaced = [module for module in MODULES if _layer(module) is None]
    assert not unplaced, ("modules in no layer (add them to LAYERS here and to CONTRIBUTING.md): "
                          + ", ".join(unplaced))


def test_imports_go_downward_only():
    upward = [_where(module, imported, line) + f": {LAYERS[_layer(module)][0]} imports {LAYERS[_layer(imported)][0]}"
              for module, edges in EDGES.items() for imported, line in edges
              if _layer(module) is not None and _layer(imported) is not None and _layer(imported) < _layer(module)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def _cycles() -> list[list[str]]:
    """The strongly connected components of the import graph with more than one module (Tarjan)."""
    graph = collections.defaultdict(set)
    for module, edges in EDGES.items():
        graph[module].update(imported for imported, _ in edges)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    return components


def _cycle_report(components: list[list[str]]) -> str:
    lines = []
    for component in components:
        members = set(component)
        lines.append("cycle: " + ", ".join(component))
        lines += ["  " + _where(module, imported, line)
                  for module in component for imported, line in EDGES[module] if imported in members]
    return "\n".join(lines)


def test_no_import_cycles():
    components = _cycles()
    assert not components, "import cycles between modules:\n" + _cycle_report(components)
