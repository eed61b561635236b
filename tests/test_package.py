"""Tests of the package as a whole: public surface, typing marker, no pickle, and the
installed layout (runtime/ installs as ``ringwire.runtime``, never as a top-level
``runtime``)."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import ringwire

ROOT = pathlib.Path(__file__).resolve().parent.parent
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


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "ringwire" / "py.typed").exists()
    assert (ROOT / "runtime" / "py.typed").exists()


# -- the installed layout: ringwire.runtime, no top-level `runtime` ---------------------------

HOSTILE_RUNTIME = 'raise SystemExit("the wrong runtime was imported (a runtime.py in the cwd)")\n'


def _python(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the interpreter in ``cwd`` (first on sys.path, as for any ``-c`` or ``-m``); the
    repository root is not on sys.path (no PYTHONPATH), so only the installed package
    counts."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *args], cwd=str(cwd), env=env, capture_output=True, text=True, timeout=60
    )


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


def test_no_top_level_runtime_is_installed(tmp_path: pathlib.Path) -> None:
    """`import runtime` does not find this project's runtime/ (which would shadow, or be
    shadowed by, any other `runtime`); ringwire.runtime does."""
    code = textwrap.dedent(
        f"""
        import importlib.metadata, importlib.util, pathlib
        folder = pathlib.Path({str(ROOT / "runtime")!r}).resolve()
        spec = importlib.util.find_spec("runtime")
        where = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
        assert not any(w and pathlib.Path(w).resolve().is_relative_to(folder) for w in where), spec
        assert "ringwire" not in importlib.metadata.packages_distributions().get("runtime", [])
        top = importlib.metadata.distribution("ringwire").read_text("top_level.txt") or ""
        assert "runtime" not in top.split(), top
        import ringwire.runtime
        origin = pathlib.Path(ringwire.runtime.__file__).resolve()
        assert origin.parent.name == "runtime" and hasattr(ringwire.runtime, "Topology"), origin
        print("ok")
        """
    )
    proc = _python(tmp_path, "-c", code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_a_runtime_py_in_the_working_directory_breaks_nothing(tmp_path: pathlib.Path) -> None:
    (tmp_path / "runtime.py").write_text(HOSTILE_RUNTIME)
    code = textwrap.dedent(
        """
        import ringwire.runtime, ringwire.demo
        from ringwire import runtime
        assert runtime.__name__ == "ringwire.runtime" and hasattr(runtime, "Topology")
        import sys
        assert "runtime" not in sys.modules, sys.modules["runtime"]
        print("ok")
        """
    )
    proc = _python(tmp_path, "-c", code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.multiprocess
def test_the_demo_runs_beside_a_runtime_py(tmp_path: pathlib.Path) -> None:
    """`python -m ringwire.demo` from a directory with a runtime.py: the front and its
    spawned workers (which re-import the runtime by module name) are not fooled."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the demo sends torch tensors")
    (tmp_path / "runtime.py").write_text(HOSTILE_RUNTIME)
    args = ("-m", "ringwire.demo", "--duration", "1", "--workers", "1", "--no-live")
    proc = _python(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wrong runtime" not in proc.stdout + proc.stderr
    assert "failed 0; wrong answers 0" in proc.stdout and "no leaks" in proc.stdout
