"""The package's layers, read from its source with `ast` (nothing is imported): no module
imports from a layer above its own, no import circle between modules at module level, no
module over 600 lines. docs/architecture.md draws these layers; LAYERS below is their one
written order.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pyplan"
MAX_LINES = 600
MAX_PACKAGE_LINES = 3000  # a room (a package folder under pyplan/, its subfolders included)

# The layers, lowest first: a module may import from its own entry (its package, or itself)
# and from the entries of the lines above; names on one line are peers and import nothing from
# each other. An entry is a module or a package (all its modules); `pyplan` alone is the
# package's own __init__ (its public names, loaded lazily).
LAYERS = """
pyplan._version pyplan._core pyplan.errors
pyplan.files
pyplan.planfile
pyplan.problem
pyplan.solver
pyplan.resolved
pyplan.lower pyplan.partition
pyplan.api
pyplan.cluster
pyplan.export pyplan.models
pyplan.comm
pyplan.mesh
pyplan.run
pyplan.measure
pyplan.train
pyplan.runtime
pyplan.options
pyplan.cli pyplan.examples
pyplan pyplan.__main__
"""

LAYER = {entry: i for i, line in enumerate(LAYERS.split("\n")[1:-1]) for entry in line.split()}


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def entry(module: str) -> str | None:
    """The entry of LAYERS a module belongs to: itself, else its innermost listed package."""
    if module == "pyplan":
        return module
    name = module
    while name != "pyplan":
        if name in LAYER:
            return name
        name = name.rpartition(".")[0]
    return None


def target(name: str) -> str:
    """The module an imported dotted name is (or lives in): the longest known prefix."""
    while name not in MODULES and name != "pyplan._core" and "." in name:
        name = name.rpartition(".")[0]
    return name


def imports(module: str, *, module_level: bool) -> list[tuple[int, str]]:
    """(line, imported pyplan module) for each import in `module`: all of them, or only those
    that run when it is imported (not in a function, nor under `if TYPE_CHECKING:`)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda)):
                continue
            if module_level and isinstance(child, ast.If) and \
                    "TYPE_CHECKING" in ast.unparse(child.test):
                visit_all(child.orelse)
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, target(a.name)) for a in child.names
                             if a.name.split(".")[0] == "pyplan")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] == "pyplan":
                    found.extend((child.lineno, target(f"{base}.{a.name}")) for a in child.names)
            visit(child)

    def visit_all(nodes) -> None:
        for node in nodes:
            visit(ast.Module(body=[node], type_ignores=[]))

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_every_module_has_a_layer():
    assert [m for m in MODULES if entry(m) is None] == [], \
        "place each new module or package in LAYERS (and in docs/architecture.md's drawing)"
    assert [e for e in LAYER if e not in MODULES and e != "pyplan._core"] == [], \
        "LAYERS names a module that does not exist"


def test_no_import_climbs_the_layers():
    climbing = []
    for module in MODULES:
        mine = entry(module)
        for line, imported in imports(module, module_level=False):
            theirs = entry(imported)
            if theirs is None or theirs != mine and LAYER[theirs] >= LAYER[mine]:
                climbing.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: "
                                f"{module} ({mine}) imports {imported} ({theirs})")
    assert climbing == [], "imports that climb the layers:\n" + "\n".join(climbing)


def test_no_import_circle_between_modules():
    graph = {m: sorted({t for _, t in imports(m, module_level=True) if t in MODULES and t != m})
             for m in MODULES}
    circles, state = [], {}  # state: 1 on the current path, 2 done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in graph[module]:
            if state.get(nxt) == 1:  # on the path: a circle back to it
                circles.append(" -> ".join((path + [module])[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, path + [module])
        state[module] = 2

    for module in graph:
        if module not in state:
            walk(module, [])
    assert circles == [], "import circles at module level:\n" + "\n".join(circles)


def test_no_module_is_over_600_lines():
    long = {str(path.relative_to(PACKAGE.parent)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules where a concern separates (at most {MAX_LINES} " \
                       "lines each)"


def test_no_package_is_over_3000_lines():
    rooms: dict[str, int] = {}
    for path in MODULES.values():
        parts = path.relative_to(PACKAGE).parts
        if len(parts) > 1:
            rooms[parts[0]] = rooms.get(parts[0], 0) + len(path.read_text().splitlines())
    large = {room: n for room, n in rooms.items() if n > MAX_PACKAGE_LINES}
    assert large == {}, f"split these packages into rooms of at most {MAX_PACKAGE_LINES} lines"


def test_the_top_of_the_package_holds_only_its_entry_points():
    """`ls pyplan/` reads as the stages a plan passes through: every module is in a room but
    the package's own entry points and its two public modules (api, errors)."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "_version.py", "api.py", "errors.py"]
