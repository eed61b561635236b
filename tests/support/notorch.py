"""Run a Python process as if torch were not installed, on a machine where it is.

:func:`env_without_torch` writes a ``sitecustomize.py`` into a folder and returns an
environment whose ``PYTHONPATH`` starts with it.  Every interpreter started with that
environment -- the process itself and whatever it spawns (multiprocessing's spawn
children inherit the environment) -- installs a ``sys.meta_path`` finder first thing
that refuses ``torch`` and every ``torch.*`` module with the ``ModuleNotFoundError`` an
absent package gives (``importlib.util.find_spec("torch")`` raises it too).  A
``sitecustomize`` it shadows is still run.

Why this beside a second virtual environment: it runs within the README's test
command, on every developer's machine alike, and costs no install.  CI also runs the
suite in a venv without torch (``.ci/run``; there the tests that need torch skip,
tests/support/extras.py), which shows what this cannot: that no dependency pulls torch
in (ringwire's are msgspec, numpy, posix_ipc, anyio and rich, and tests/unit/test_demo.py
checks that none of them is torch).
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

SITECUSTOMIZE = textwrap.dedent(
    '''
    """Written by tests/support/notorch.py: torch is "not installed" here."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import os
    import sys

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTorch())

    def _chain():  # run the sitecustomize this one shadows, if there is one
        here = os.path.dirname(os.path.abspath(__file__))
        rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)

    _chain()
    '''
)


def env_without_torch(folder: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which ``import torch`` fails, for subprocesses (``folder``
    receives the ``sitecustomize.py``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(folder), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    return env


def torch_hidden(env: dict[str, str]) -> bool:
    """Does ``import torch`` fail in a child started with ``env``?  (The check that
    the blocker took effect; a ``-c`` child, so it is for process tests only.)"""
    import subprocess

    code = "import torch"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return proc.returncode != 0 and "No module named 'torch'" in proc.stderr
