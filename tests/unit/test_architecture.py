"""The daemon's parts keep to their seams (docs/architecture.md): read from the source, no model needed.

Runtime imports only: an import under ``if TYPE_CHECKING:`` is for type
checkers and never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DAEMON = Path(__file__).resolve().parents[2] / "daemon"
PACKAGE = "prefixd.daemon"
PARTS = ("front", "engine", "cache", "kv", "persist", "models", "service", "distributed")


def module_name(path: Path) -> str:
    parts = path.relative_to(DAEMON).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def runtime_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import that runs, lazy ones included."""
    tree = ast.parse(path.read_text())
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if is_type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            found.append((target, names))
            # ``from . import x``: x may be a module of that package
            found.extend((f"{target}.{name}", []) for name in names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


MODULES = {module_name(p): p for p in DAEMON.rglob("*.py")}
GRAPH = {
    name: sorted({target for target, _ in runtime_imports(path) if target in MODULES and target != name})
    for name, path in MODULES.items()
}


def part_of(module: str) -> str | None:
    rest = module.removeprefix(PACKAGE + ".").split(".")
    return rest[0] if rest[0] in PARTS else None


def test_the_tree_shows_the_parts():
    for part in PARTS:
        assert (DAEMON / part / "__init__.py").is_file(), part
    loose = sorted(p.name for p in DAEMON.glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert loose == ["common_prefix.py", "cuda.py"], "modules belong in a part's folder"


def test_the_import_graph_has_no_cycles():
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in GRAPH[module]:
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target] if target in path else [module, target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in GRAPH:
        if module not in state:
            visit(module, [module])


def test_the_parts_depend_on_each_other_in_one_direction():
    edges = {(part_of(a), part_of(b)) for a, targets in GRAPH.items() for b in targets}
    edges = {(a, b) for a, b in edges if a and b and a != b}
    for a, b in edges:
        assert (b, a) not in edges, f"{a}/ and {b}/ import each other"


def test_the_cache_store_imports_no_mlx():
    cache_modules = [m for m in MODULES if part_of(m) == "cache"]
    seen, stack = set(), list(cache_modules)
    while stack:  # everything the cache part pulls in, transitively
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        for target, _ in runtime_imports(MODULES[module]):
            assert not target.split(".")[0].startswith("mlx"), f"{module} imports {target}"
            if target in MODULES:
                stack.append(target)


def test_no_module_takes_a_private_name_from_another_part():
    for name, path in MODULES.items():
        for target, names in runtime_imports(path):
            if target in MODULES and part_of(target) != part_of(name):
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{name} imports {private} from {target}"
