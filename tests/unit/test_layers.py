"""The package's layers, checked on its source: imports point one way (down), the two
transports never import each other, no module imports itself through others (no
import circles), the wire format touches no OS interface, no module imports another
module's private names, and no module is too long to read in a sitting."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "ringwire"
# what each layer may import from ringwire (beyond itself and ringwire._errors)
ALLOWED = {
    "_wire": set(),
    "_pool": {"_wire"},  # what every transport's tensor pools share
    "_shm": {"_wire", "_pool"},  # the shared-memory transport...
    "_net": {"_wire", "_pool"},  # ...and the TCP one beside it: neither imports the other
    "_conn": {"_wire", "_pool", "_shm", "_net"},
}
OS_MODULES = {"socket", "select", "mmap", "posix_ipc", "selectors", "asyncio", "anyio"}
MAX_LINES = 800


def modules() -> list[pathlib.Path]:
    files = sorted(PKG.rglob("*.py")) + sorted((ROOT / "runtime").rglob("*.py"))
    assert len(files) > 30
    return files


def imported(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(absolute module, names)`` for every ``from X import names`` in ``path``."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    if rel[0] == "runtime":
        rel = ("ringwire", *rel)  # it installs as ringwire.runtime
    package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def layer_of(path: pathlib.Path) -> str | None:
    parts = path.relative_to(PKG).parts if path.is_relative_to(PKG) else ()
    return parts[0] if parts and parts[0] in ALLOWED else None


def test_imports_point_down() -> None:
    for path in modules():
        layer = layer_of(path)
        if layer is None:
            continue
        for mod, _ in imported(path):
            parts = mod.split(".")
            if parts[0] != "ringwire" or len(parts) < 2 or parts[1] in (layer, "_errors"):
                continue
            assert parts[1] in ALLOWED[layer], f"{path.relative_to(ROOT)} imports {mod}"


def test_the_wire_format_touches_no_os_interface() -> None:
    for path in (PKG / "_wire").rglob("*.py"):
        for mod, _ in imported(path):
            assert mod.split(".")[0] not in OS_MODULES, f"{path.name} imports {mod}"


def test_no_module_imports_another_modules_private_names() -> None:
    for path in modules():
        for mod, names in imported(path):
            if not mod.startswith("ringwire"):
                continue
            parts = mod.split(".")
            if parts[:2] == ["ringwire", "runtime"]:
                where = ROOT / "runtime" / pathlib.Path(*parts[2:])
            else:
                where = ROOT / pathlib.Path(*parts)
            for name in names:
                is_module = (where / f"{name}.py").exists()  # a submodule, not a name
                if name.startswith("_") and not name.startswith("__") and not is_module:
                    raise AssertionError(f"{path.relative_to(ROOT)}: from {mod} import {name}")


def test_every_exception_class_lives_in_the_errors_module() -> None:
    for path in PKG.rglob("*.py"):
        if path.name == "_errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not any(b.endswith(("Error", "Exception")) for b in bases), (
                    f"{path.relative_to(ROOT)}: class {node.name}({', '.join(bases)})"
                )


def test_every_module_fits_a_sitting() -> None:
    for path in modules():
        n = len(path.read_text().splitlines())
        assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines"


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("").parts
    if rel[0] == "runtime":
        rel = ("ringwire", *rel)  # it installs as ringwire.runtime
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def import_graph() -> dict[str, set[str]]:
    """Every ringwire module -> the ringwire modules it imports.

    Counted: every ``import`` and ``from ... import`` anywhere in the file -- at module
    level, inside functions (an import deferred to call time is still a dependency, and
    the usual hiding place of a circle) and under ``if TYPE_CHECKING:`` (the reader and
    the type checker follow it).  ``from package import name`` depends on the submodule
    ``package.name`` where that is a module, else on the package.  Not counted: the
    implicit import of a module's parent packages (Python runs a package's
    ``__init__`` before any of its modules, so that is no edge of a circle)."""
    names = {module_name(p): p for p in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        edges = graph[name] = set()
        for mod, imported_names in imported(path):
            if mod.split(".")[0] == "ringwire":
                subs = [f"{mod}.{n}" for n in imported_names if f"{mod}.{n}" in names]
                if subs and len(subs) == len(imported_names):
                    edges.update(subs)
                elif mod in names:
                    edges.add(mod)
                    edges.update(subs)
        edges.discard(name)
    return graph


def test_import_graph_resolves_submodules_and_hidden_imports() -> None:
    graph = import_graph()
    assert "ringwire._wire.ext" in graph["ringwire._wire.codec"]  # from . import ext as X
    assert "ringwire._wire.codec" not in graph["ringwire._wire.ext"]
    assert "ringwire._net.handshake" in graph["ringwire._conn.netconn"]  # inside a function
    assert "ringwire.runtime" in graph and "ringwire" in graph


def test_no_import_circles() -> None:
    """No ringwire module imports itself through others (see :func:`import_graph`)."""
    graph = import_graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
