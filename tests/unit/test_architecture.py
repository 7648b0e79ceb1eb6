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


# -- one owner for private members -----------------------------------------------------------
# A private method or attribute (``_name``) belongs to the module that defines it. Another module
# neither overrides it in a subclass nor writes it on an object, and does not replace another part's
# methods on its objects: what differs between uses of a class is a parameter or a collaborator.


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class Source:
    """One module as the checks below read it: its classes and the names its imports bind."""

    def __init__(self, name: str, tree: ast.Module, is_package: bool = False):
        self.name = name
        self.tree = tree
        package = name if is_package else name.rpartition(".")[0]
        self.imports: dict[str, tuple[str, str | None]] = {}  # local name -> (module, name in it; None: the module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (target, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports[alias.asname or alias.name.split(".")[0]] = (alias.name if alias.asname else
                                                                              alias.name.split(".")[0], None)
        self.classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        # Private names this module owns: its classes' methods and class attributes, and ``self._x = ...``.
        self.owned: set[str] = set()
        for cls in self.classes.values():
            self.owned.update(class_members(cls))
        for node in ast.walk(tree):
            for target in assigned_attributes(node):
                if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
                    self.owned.add(target.attr)


def class_members(cls: ast.ClassDef) -> set[str]:
    members = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(node.name)
        elif isinstance(node, ast.Assign):
            members.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
    return members


def plain_methods(cls: ast.ClassDef) -> set[str]:
    """Methods defined with ``def`` that are not properties (a property's value is data)."""
    return {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not any("property" in ast.unparse(d) or "setter" in ast.unparse(d) for d in node.decorator_list)}


def assigned_attributes(node: ast.AST) -> list[ast.Attribute]:
    """``x.attr`` written by this statement: ``x.attr = ...`` (in any unpacking), ``x.attr += ...``, ``setattr``."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
          and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return [ast.Attribute(value=node.args[0], attr=node.args[1].value, ctx=ast.Store())]
    else:
        return []
    found = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute):
            found.append(target)
    return found


def resolve_class(sources: dict[str, Source], module: str, expr: ast.expr,
                  seen: frozenset[str] = frozenset()) -> tuple[str, ast.ClassDef] | None:
    """The class a base-class expression names, following imports and re-exports; None outside ``sources``."""
    source = sources.get(module)
    if source is None or module in seen:
        return None
    if isinstance(expr, ast.Name):
        if expr.id in source.classes:
            return module, source.classes[expr.id]
        imported = source.imports.get(expr.id)
        if imported is None:
            return None
        target, name = imported
        if name is None:
            return None
        if f"{target}.{name}" in sources:  # ``from package import module``: not a class
            return None
        return resolve_class(sources, target, ast.Name(id=name), seen | {module})
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        imported = source.imports.get(expr.value.id)
        if imported is not None:
            target, name = imported
            module_name = target if name is None else f"{target}.{name}"
            return resolve_class(sources, module_name, ast.Name(id=expr.attr), seen | {module})
    return None


def inherited_private_methods(sources: dict[str, Source], module: str, cls: ast.ClassDef,
                              seen: frozenset[int] = frozenset()) -> dict[str, str]:
    """Private members of ``cls``'s base classes (transitively) -> the module that defines each."""
    found: dict[str, str] = {}
    for base in cls.bases:
        resolved = resolve_class(sources, module, base)
        if resolved is None or id(resolved[1]) in seen:
            continue
        base_module, base_cls = resolved
        found.update(inherited_private_methods(sources, base_module, base_cls, seen | {id(base_cls)}))
        found.update({name: base_module for name in class_members(base_cls) if is_private(name)})
    return found


def private_overrides(sources: dict[str, Source]) -> list[str]:
    """A class that defines a private member of a base class another module defines."""
    problems = []
    for module, source in sources.items():
        for cls in source.classes.values():
            inherited = inherited_private_methods(sources, module, cls)
            for name in sorted(class_members(cls) & inherited.keys()):
                if inherited[name] != module:
                    problems.append(f"{module}.{cls.name} overrides {name} of {inherited[name]}")
    return problems


def data_attributes(source: Source) -> set[str]:
    """Names this module's classes hold as data: class attributes and fields, and ``self.x = ...``."""
    names = set()
    for cls in source.classes.values():
        names.update(class_members(cls) - plain_methods(cls))
    for node in ast.walk(source.tree):
        names.update(t.attr for t in assigned_attributes(node)
                     if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
    return names


def foreign_writes(sources: dict[str, Source]) -> list[str]:
    """``obj._x = ...`` on a private name another module owns; ``obj.method = ...`` over another module's method.

    Read from the source, without types: a name counts as another module's method only where no
    module holds it as data (``seq.lease = ...`` writes a field, whatever else is called ``lease``),
    and names no module of the package owns (a library's) are not this check's.
    """
    methods = {module: set().union(*(plain_methods(c) for c in source.classes.values()))
               for module, source in sources.items()}
    data = set().union(*(data_attributes(source) for source in sources.values()))
    problems = []
    for module, source in sources.items():
        for node in ast.walk(source.tree):
            for target in assigned_attributes(node):
                if (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")) or target.attr in source.owned:
                    continue
                where = f"{module}:{node.lineno} writes {ast.unparse(target)}"
                if is_private(target.attr):
                    owners = sorted(m for m, other in sources.items() if m != module and target.attr in other.owned)
                    if owners:
                        problems.append(f"{where}, a private name of {', '.join(owners)}")
                elif target.attr not in data:
                    owners = sorted(m for m, names in methods.items() if m != module and target.attr in names)
                    if owners:
                        problems.append(f"{where}, a method of {', '.join(owners)}")
    return problems


def daemon_sources() -> dict[str, Source]:
    return {name: Source(name, ast.parse(path.read_text()), path.name == "__init__.py") for name, path in MODULES.items()}


def test_no_class_overrides_another_modules_private_methods():
    assert private_overrides(daemon_sources()) == []


def test_no_module_writes_another_modules_private_names_or_replaces_its_methods():
    assert foreign_writes(daemon_sources()) == []


def test_the_ownership_checks_catch_a_subclass_and_a_patch():
    """What a mode written as a subclass of the engine did, in two small modules: both checks object."""
    base = ast.parse(
        "class Engine:\n"
        "    def _iterate(self):\n        pass\n"
        "    def stats(self):\n        pass\n"
        "class Residency:\n"
        "    def unload_expired(self):\n        pass\n"
        "class Scheduler:\n"
        "    def __init__(self):\n        self._held = None\n")
    mode = ast.parse(
        "from ..engine.engine import Engine\n"
        "class RankEngine(Engine):\n"
        "    def _iterate(self):\n        self.residency.unload_expired = lambda: None\n"
        "    def stats(self):\n        self.scheduler._held = None\n")
    sources = {"pkg.engine.engine": Source("pkg.engine.engine", base),
               "pkg.ranks.mode": Source("pkg.ranks.mode", mode)}
    assert private_overrides(sources) == ["pkg.ranks.mode.RankEngine overrides _iterate of pkg.engine.engine"]
    assert foreign_writes(sources) == [
        "pkg.ranks.mode:4 writes self.residency.unload_expired, a method of pkg.engine.engine",
        "pkg.ranks.mode:6 writes self.scheduler._held, a private name of pkg.engine.engine"]
