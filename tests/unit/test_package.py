"""Tests of the package as a whole, read from the source tree: public surface, typing
marker, no pickle, the package list of pyproject.toml.  The installed layout (in fresh
interpreters) is in tests/process/test_package.py."""

from __future__ import annotations

import ast
import pathlib

import pytest

import ringwire

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: two up from tests/<folder>/
FORBIDDEN_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "_pickle", "shelve", "marshal"}


def _python_files() -> list[pathlib.Path]:
    return [p for d in ("ringwire", "runtime") for p in sorted((ROOT / d).rglob("*.py"))]


def test_no_pickle_anywhere_on_the_wire_path() -> None:
    offenders = []
    for path in _python_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module.split(".")[0]}
            elif isinstance(node, ast.Attribute) and node.attr in {"load", "loads"}:
                base = node.value
                names = {base.id} if isinstance(base, ast.Name) and base.id == "torch" else set()
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                names = {"__import__"} if node.func.id == "__import__" else set()
            else:
                continue
            bad = names & (FORBIDDEN_MODULES | {"torch", "__import__"})
            if bad - {"torch"} or (isinstance(node, ast.Attribute) and bad):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(bad)}")
    assert not offenders, offenders
    assert len(_python_files()) >= 5  # the scan really looked at the package


def test_public_names_are_curated_and_importable() -> None:
    assert sorted(ringwire.__all__) == sorted(set(ringwire.__all__))
    for name in ringwire.__all__:
        assert hasattr(ringwire, name), name
    assert not [n for n in ringwire.__all__ if n.startswith("_") and n != "__version__"]


@pytest.mark.parametrize("module", ["ringwire", "ringwire.wire"])
def test_all_is_sorted_unique_and_every_name_resolves(module: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    names = list(mod.__all__)
    assert names == sorted(names), [a for a, b in zip(names, sorted(names)) if a != b][:3]
    assert len(names) == len(set(names))
    ns: dict[str, object] = {}
    exec(f"from {module} import *", ns)  # what a star import really gives
    assert sorted(n for n in ns if n != "__builtins__") == sorted(names)
    for name in names:
        assert getattr(mod, name) is ns[name], name


def test_wire_descriptors_live_in_ringwire_wire_only() -> None:
    """The wire format's descriptors are not the application API: they are in
    ringwire.wire, out of the top-level namespace.  (SlotClass is configuration --
    what SlotConfig(classes=...) is made of -- and stays at the top level.)"""
    wire_names = {"CudaRef", "ExtCode", "NetRef", "NixlRef", "SlotRef"}
    assert "SlotClass" in ringwire.__all__
    assert set(ringwire.wire.__all__) == wire_names
    assert not wire_names & set(ringwire.__all__)
    assert not [n for n in wire_names if hasattr(ringwire, n)]
    assert ringwire.wire.__doc__ and "wire" in ringwire.wire.__doc__


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "ringwire" / "py.typed").exists()
    assert (ROOT / "runtime" / "py.typed").exists()


def test_setuptools_packages_cover_every_package_folder() -> None:
    """pyproject.toml lists the packages (a find: cannot follow the package-dir mapping
    of runtime/ to ringwire.runtime): every folder with an __init__.py under ringwire/
    and runtime/ must be listed, or a normal (non-editable) install would lack it."""
    tomllib = pytest.importorskip("tomllib")
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"] == {"ringwire.runtime": "runtime"}
    folders = {"ringwire": ROOT / "ringwire", "ringwire.runtime": ROOT / "runtime"}
    expected = {
        ".".join((name, *init.parent.relative_to(top).parts))
        for name, top in folders.items()
        for init in top.rglob("__init__.py")
    }
    assert sorted(conf["packages"]) == sorted(expected)
    for pkg in folders:
        assert "py.typed" in conf["package-data"][pkg], pkg
    assert "runtime" not in conf["packages"] and "runtime" not in conf["package-data"]
    # mypy checks runtime/ as ringwire.runtime through this link (see [tool.mypy])
    link = ROOT / ".mypy-path" / "ringwire" / "runtime"
    assert link.is_symlink() and link.resolve() == (ROOT / "runtime").resolve()
