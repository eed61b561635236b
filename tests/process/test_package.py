"""The installed layout, in fresh interpreters: runtime/ installs as ``ringwire.runtime``,
never as a top-level ``runtime``, and a runtime.py in the working directory fools
nothing (the demo included)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts a process

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: two up from tests/<folder>/


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
